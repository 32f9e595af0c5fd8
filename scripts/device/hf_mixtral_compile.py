"""Does the *unpatched* HF Mixtral (default CUDA experts, fp32) compile with Inductor, fullgraph?"""

import torch
from tests.transformers.model_configs import build_model, random_batch

for implementation in ("grouped_mm", "batched_mm"):
    torch._dynamo.reset()
    model = build_model("mixtral", seed=0, use_cache=False, experts_implementation=implementation)
    model.train()
    try:
        loss = torch.compile(model, fullgraph=True)(**random_batch(1024, batch=2, seq=12)).loss
        loss.backward()
        print(f"HF mixtral ({model.config._experts_implementation}) compiled: loss {loss.item():.6f}")
    except Exception as exc:  # noqa: BLE001 - reporting what HF's own model raises
        print(f"HF mixtral ({model.config._experts_implementation}) failed: {type(exc).__name__}: {str(exc)[:300]}")
