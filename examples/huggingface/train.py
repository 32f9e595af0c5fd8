"""Fine-tune a causal LM with the Hugging Face Trainer and ``use_liger_kernel=True``.

Every ``TrainingArguments`` flag is accepted (``--fsdp``, ``--deepspeed``, ``--bf16``,
``--gradient_checkpointing``, ...); this script only changes some defaults:
``--use_liger_kernel True``, ``--report_to none``, ``--save_strategy no``, ``--logging_steps 1``.
``Trainer.train()`` then patches the model through
``liger_kernel.transformers._apply_liger_kernel_to_instance`` (Liger RMSNorm, RoPE, SwiGLU
and the fused linear cross entropy for the supported families).

The model comes from a local checkpoint (``--model_path DIR``: config, weights and,
if present, tokenizer; nothing is downloaded) or is built with random weights from a
preset / JSON config (``--model_config tiny|small|path.json``, a Llama). The data is a local
text file (``--data_file``), tokenized with the checkpoint's tokenizer or, without one, as
bytes (vocabulary 256 + 1).

    python examples/huggingface/train.py --model_config tiny --max_steps 3 --use_cpu True   # smoke
    python examples/huggingface/train.py --model_path ./my-llama --data_file corpus.txt --torch_dtype bfloat16 \\
        --max_steps 1000 --per_device_train_batch_size 8 --seq_len 2048

See README.md beside this file for FSDP and DeepSpeed launches.
"""

import json
import os
import sys
import sysconfig
from dataclasses import dataclass, field

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before liger_kernel imports triton

import transformers
from liger_kernel.transformers import liger_patched_modules
from transformers import (
    AutoModelForCausalLM,
    HfArgumentParser,
    LlamaConfig,
    Trainer,
    TrainingArguments,
)

PRESETS = {
    "tiny": dict(hidden_size=64, intermediate_size=176, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2),
    "small": dict(hidden_size=512, intermediate_size=1408, num_hidden_layers=8, num_attention_heads=8,
                  num_key_value_heads=4),
}
BYTE_VOCAB = 257  # 256 byte values + an end-of-document id


@dataclass
class ScriptArguments:
    model_path: str | None = field(default=None, metadata={"help": "local checkpoint directory to fine-tune"})
    model_config: str = field(default="tiny", metadata={
        "help": "without --model_path: a preset (tiny, small) or a JSON file of LlamaConfig fields"})
    data_file: str = field(default=os.path.join(sysconfig.get_paths()["stdlib"], "argparse.py"),
                           metadata={"help": "local text file to train on"})
    seq_len: int = field(default=128, metadata={"help": "tokens per training sequence"})
    torch_dtype: str = field(default="float32", metadata={
        "help": "dtype of the weights: float32 (with --bf16 True for autocast) or bfloat16 (pure bf16 training)",
        "choices": ["float32", "bfloat16"]})


class Blocks(torch.utils.data.Dataset):
    def __init__(self, tokens: torch.Tensor, seq_len: int):
        n_blocks = tokens.numel() // seq_len
        if n_blocks == 0:
            raise ValueError(f"the data holds {tokens.numel()} tokens, fewer than --seq_len {seq_len}")
        self.blocks = tokens[: n_blocks * seq_len].view(n_blocks, seq_len)

    def __len__(self):
        return self.blocks.shape[0]

    def __getitem__(self, index):
        return {"input_ids": self.blocks[index], "labels": self.blocks[index]}


def build_model(script: ScriptArguments, dtype: torch.dtype):
    if script.model_path:
        return AutoModelForCausalLM.from_pretrained(script.model_path, local_files_only=True, dtype=dtype)
    if script.model_config in PRESETS:
        fields = dict(PRESETS[script.model_config])
    elif os.path.isfile(script.model_config):
        with open(script.model_config) as handle:
            fields = json.load(handle)
    else:
        raise ValueError(f"--model_config must be one of {sorted(PRESETS)} or a JSON file, got {script.model_config!r}")
    fields.setdefault("vocab_size", BYTE_VOCAB)
    config = LlamaConfig(**fields, tie_word_embeddings=True, use_cache=False, attn_implementation="sdpa",
                         max_position_embeddings=max(2048, script.seq_len))
    return AutoModelForCausalLM.from_config(config, dtype=dtype)


def tokenize(script: ScriptArguments) -> torch.Tensor:
    with open(script.data_file, "rb") as handle:
        data = handle.read()
    tokenizer_files = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json")
    if script.model_path and any(os.path.exists(os.path.join(script.model_path, f)) for f in tokenizer_files):
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(script.model_path, local_files_only=True)
        return torch.tensor(tokenizer(data.decode("utf-8", errors="replace"))["input_ids"])
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).long()


def main(argv=None) -> int:
    parser = HfArgumentParser((ScriptArguments, TrainingArguments))
    parser.set_defaults(output_dir="hf_example_out", use_liger_kernel=True, report_to="none", save_strategy="no",
                        logging_steps=1, max_steps=20, per_device_train_batch_size=4, learning_rate=1e-3,
                        lr_scheduler_type="cosine", warmup_steps=2)
    script, training_args = parser.parse_args_into_dataclasses(args=argv)
    transformers.set_seed(training_args.seed)

    dtype = getattr(torch, script.torch_dtype)
    model = build_model(script, dtype)
    tokens = tokenize(script)
    if int(tokens.max()) >= model.config.vocab_size:
        raise ValueError(f"token id {int(tokens.max())} >= vocab_size {model.config.vocab_size}")
    train_set = Blocks(tokens, script.seq_len)
    print(f"model {type(model).__name__} ({sum(p.numel() for p in model.parameters()) / 1e6:.2f} M params, {dtype}), "
          f"{len(train_set)} blocks of {script.seq_len} tokens from {script.data_file}, "
          f"use_liger_kernel={training_args.use_liger_kernel}")

    trainer = Trainer(model=model, args=training_args, train_dataset=train_set)
    result = trainer.train()
    patched = len(liger_patched_modules(model))
    print(f"train_loss {result.training_loss:.4f} over {result.global_step} steps; "
          f"{patched} modules run Liger forwards")
    if training_args.save_strategy != "no":
        trainer.save_model()
    return 0


if __name__ == "__main__":
    sys.exit(main())
