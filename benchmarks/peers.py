"""Other libraries' kernels as optional benchmark providers, timed like ours in the same run.

In-process peers (``python -m benchmarks --peers ...``), registered in
``harness.EXTRA_PROVIDERS`` when asked for; one that cannot be imported (or needs CUDA on a
CPU run) still gets its rows, with status ``skipped: <reason>``:

* ``cut_cross_entropy`` (Apple's ``cut-cross-entropy``): ``linear_cross_entropy(x, W,
  target)`` for fused linear cross entropy, with its defaults (the ``cce`` kernels and
  ``filter_eps="high"``, which skips gradient entries below a bf16-scale threshold);
* ``trl`` (TRL >= 1.13's ``trl.kernels``): ``ChunkedLogProbFunction`` for the per-token
  log-probs and entropies, ``ChunkedDivergenceFunction`` for the fused linear JSD, as its
  trainers call them;
* ``quack`` (``quack-kernels``, CuTe DSL): ``quack.rmsnorm.rmsnorm`` (rows flattened to 2-D),
  ``quack.cross_entropy.cross_entropy``, ``quack.linear_cross_entropy.chunked_linear_cross_entropy``.

The upstream Liger-Kernel release is another package named ``liger_kernel``, so it runs in
a child process whose ``PYTHONPATH`` is its install directory followed by this repository
(not ``src``): ``python -m benchmarks.peers ops REQUEST.json`` builds the same op specs,
registers provider ``liger_upstream`` from ``liger_kernel.transformers.functional`` and runs
the same ``harness.Runner`` with the parent's measured hardware, writing its rows as JSON;
:func:`run_upstream_ops` merges them. For the end-to-end benchmark,
:func:`benchmarks.e2e_training.run_upstream_e2e`
runs ``benchmarks/e2e_training.py --variants liger`` the same way (variant
``liger-upstream``). The child checks that ``liger_kernel`` came from the given directory.

Each row records the provider's version (``provider_version``) beside GPU, torch, triton,
transformers and date.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parents[1]
UPSTREAM = "liger_upstream"
NORM_EPS = 1e-6  # benchmarks.bench_norms' epsilon


def _loss_only(result):
    return result[0] if isinstance(result, tuple) else result


# --------------------------------------------------------------------------------------
# Provider functions (each import happens when the provider is built)
# --------------------------------------------------------------------------------------


def _cce_linear_cross_entropy():
    from cut_cross_entropy import linear_cross_entropy

    return lambda x, weight, target: linear_cross_entropy(x, weight, target)


def _quack_rms_norm():
    from quack.rmsnorm import rmsnorm

    def fn(x, weight):
        return rmsnorm(x.reshape(-1, x.shape[-1]), weight, eps=NORM_EPS).view(x.shape)

    return fn


def _quack_cross_entropy():
    from quack.cross_entropy import cross_entropy

    return lambda logits, target: cross_entropy(logits, target)


def _quack_linear_cross_entropy():
    from quack.linear_cross_entropy import chunked_linear_cross_entropy

    return lambda x, weight, target: chunked_linear_cross_entropy(x, weight, target)


# TRL's fused-head kernels (trl >= 1.13), called as its trainers call them: 32768-wide
# vocabulary tiles (``trl.trainer.utils._CHUNKED_LOGPROB_CHUNK_SIZE``), no softcap, scale 1.
TRL_VOCAB_TILE = 32768


def _trl_logprobs():
    from trl.kernels.chunked_logprob import ChunkedLogProbFunction

    def fn(x, weight, ids, logp_grad, entropy_grad):
        logp, entropy, *_ = ChunkedLogProbFunction.apply(x, weight, None, ids, 1.0, TRL_VOCAB_TILE, None, 1.0,
                                                         ("entropy",))
        return (logp * logp_grad + entropy * entropy_grad).sum()

    return fn


def _trl_jsd():
    from trl.kernels.chunked_divergence import ChunkedDivergenceFunction

    from benchmarks.bench_rl_distillation import JSD_BETA

    def fn(x, weight, teacher_x, teacher_weight, labels):
        divergence, _ = ChunkedDivergenceFunction.apply(x, weight, None, teacher_x, teacher_weight, None, JSD_BETA)
        return divergence.mean()

    return fn


def _upstream_chunked(module: str, name: str):
    """Our benchmark's provider of a chunked loss, built in the child, where ``liger_kernel``
    is the upstream release: the two share the loss classes' names and call shapes."""
    def build():
        return getattr(importlib.import_module(module), name)()

    return build


def _upstream(name: str, call: Callable[[Callable], Callable]):
    def build():
        functional = importlib.import_module("liger_kernel.transformers.functional")
        return call(getattr(functional, name))

    return build


# The upstream release writes gradients into its inputs / the upstream gradient in several
# ops (cross entropy over the logits, RMSNorm's dX over dY, RoPE over dq/dk, SwiGLU/GEGLU
# over a and b): those buffers are restored before every call, untimed, as for ours.
UPSTREAM_OPS = {
    "rms_norm": (_upstream("liger_rms_norm", lambda f: lambda x, w: f(x, w, NORM_EPS)), ("grad_output",)),
    "layer_norm": (_upstream("liger_layer_norm", lambda f: lambda x, w, b: f(x, w, b, NORM_EPS)), ("grad_output",)),
    "rope": (_upstream("liger_rope", lambda f: lambda q, k, cos, sin: f(q, k, cos, sin)), ("grad_output",)),
    "swiglu": (_upstream("liger_swiglu", lambda f: f), ("grad_output", 0, 1)),
    "geglu": (_upstream("liger_geglu", lambda f: f), ("grad_output", 0, 1)),
    "cross_entropy": (_upstream("liger_cross_entropy", lambda f: lambda x, t: _loss_only(f(x, t))), (0,)),
    "fused_linear_cross_entropy": (
        _upstream("liger_fused_linear_cross_entropy", lambda f: lambda x, w, t: _loss_only(f(x, w, t))), ()),
    "dpo": (_upstream_chunked("benchmarks.bench_post_training", "_liger_dpo"), ()),
    "grpo": (_upstream_chunked("benchmarks.bench_rl_distillation", "_liger_grpo"), ()),
    "fused_linear_jsd": (_upstream_chunked("benchmarks.bench_rl_distillation", "_liger_jsd"), ()),
}


@dataclass
class Peer:
    """One optional provider: ``ops`` maps an op name to (builder of the function, mutated args)."""

    name: str
    module: str  # imported to decide availability
    distribution: str  # for the version
    ops: dict[str, tuple[Callable[[], Callable], tuple]]
    needs_cuda: bool = True
    note: str = ""  # recorded with the version (settings that matter when reading the numbers)
    unavailable: str = ""
    version: str = ""
    found: dict[str, Any] = field(default_factory=dict)

    def probe(self, device: torch.device) -> Peer:
        """Set ``unavailable`` (why it cannot run here) or ``version``."""
        if self.needs_cuda and device.type != "cuda":
            self.unavailable = f"{self.distribution} needs CUDA"
            return self
        try:
            importlib.import_module(self.module)
        except Exception as exc:  # any import failure means "not here"
            self.unavailable = f"{self.distribution} not importable: {type(exc).__name__}: {str(exc)[:120]}"
            return self
        self.version = _dist_version(self.distribution) + (f" ({self.note})" if self.note else "")
        return self

    def build(self, spec) -> tuple[Callable, tuple]:
        builder, mutates = self.ops[spec.name]
        return builder(), mutates


def _dist_version(distribution: str) -> str:
    try:
        return f"{distribution} {importlib.metadata.version(distribution)}"
    except importlib.metadata.PackageNotFoundError:
        return f"{distribution} (version unknown)"


def in_process_peers() -> dict[str, Peer]:
    return {
        "cut_cross_entropy": Peer(
            "cut_cross_entropy", "cut_cross_entropy", "cut-cross-entropy",
            {"fused_linear_cross_entropy": (_cce_linear_cross_entropy, ())}, note="impl cce, filter_eps high"),
        "trl": Peer(
            "trl", "trl.kernels.chunked_logprob", "trl",
            {"fused_linear_logprobs": (_trl_logprobs, ()), "fused_linear_jsd": (_trl_jsd, ())},
            note=f"trl.kernels, vocabulary tile {TRL_VOCAB_TILE}"),
        "quack": Peer(
            "quack", "quack", "quack-kernels",
            {"rms_norm": (_quack_rms_norm, ()), "cross_entropy": (_quack_cross_entropy, ()),
             "fused_linear_cross_entropy": (_quack_linear_cross_entropy, ())}),
    }


PEER_NAMES = (*in_process_peers(), UPSTREAM)


def register(names, device: torch.device) -> list[str]:
    """Probe the in-process peers among ``names`` and register them; returns their provider names."""
    from benchmarks import harness

    peers = in_process_peers()
    registered = []
    for name in names:
        if name in peers:
            harness.EXTRA_PROVIDERS[name] = peers[name].probe(device)
            registered.append(name)
    return registered


def describe(names) -> str:
    from benchmarks import harness

    return "; ".join(f"{n}: {p.unavailable or p.version}" for n, p in harness.EXTRA_PROVIDERS.items() if n in names)


# --------------------------------------------------------------------------------------
# The upstream release, in a child process
# --------------------------------------------------------------------------------------


def upstream_env(path: str) -> dict[str, str]:
    """Environment of a child that imports the upstream ``liger_kernel`` from ``path``."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(Path(path).resolve()), str(REPO)])
    env["LIGER_UPSTREAM_PATH"] = str(Path(path).resolve())
    return env


def check_upstream_import(path: str) -> str:
    """The upstream version, after checking ``liger_kernel`` was imported from ``path``."""
    import liger_kernel

    where = Path(liger_kernel.__file__).resolve()
    if Path(path).resolve() not in where.parents:
        raise RuntimeError(f"liger_kernel was imported from {where}, not from the upstream path {path}")
    for dist in importlib.metadata.distributions(path=[str(Path(path).resolve())]):
        if (dist.metadata["Name"] or "").lower().replace("_", "-") == "liger-kernel":
            return f"liger-kernel {dist.version}"
    return "liger-kernel (version unknown)"


def run_upstream_ops(path: str, cfg, hw, ops: list[str], log=print, max_seconds: float | None = None) -> list:
    """Rows of provider ``liger_upstream`` for ``ops`` under ``cfg`` (a ``harness.RunConfig``),
    measured in a child process (which stops starting cases after ``max_seconds``, default
    ``cfg.max_seconds``); one ``skipped`` row per case when it cannot run."""
    from benchmarks import harness

    seconds = cfg.max_seconds if max_seconds is None else max_seconds
    request = dict(path=path, ops=ops, device=cfg.device.type, dtype=str(cfg.dtype).replace("torch.", ""),
                   modes=list(cfg.modes), quick=cfg.quick, tiny=cfg.tiny, max_seconds=seconds,
                   timing=asdict(cfg.timing), hardware=asdict(hw))
    reason = ""
    if not path or not Path(path).is_dir():
        reason = f"no upstream liger_kernel directory ({path or 'unset'}; --upstream-path / LIGER_UPSTREAM_PATH)"
    else:
        with tempfile.TemporaryDirectory() as tmp:
            req, out = Path(tmp) / "request.json", Path(tmp) / "rows.json"
            req.write_text(json.dumps(request))
            proc = subprocess.run([sys.executable, "-m", "benchmarks.peers", "ops", str(req), str(out)],
                                  cwd=REPO, env=upstream_env(path), capture_output=True, text=True)
            if proc.returncode == 0 and out.exists():
                rows = [harness.Row(**r) for r in json.loads(out.read_text())]
                log(f"{UPSTREAM}: {len(rows)} rows from {path}")
                return rows
            tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["no output"]
            reason = f"upstream child failed (exit {proc.returncode}): {tail[0][:160]}"
    log(f"{UPSTREAM}: {reason}")
    return _skipped_rows(reason, request)


def _skipped_rows(reason: str, request: dict) -> list:
    from benchmarks import harness
    from benchmarks.specs import load_specs

    cfg = _run_config(request)
    peer = Peer(UPSTREAM, "liger_kernel", "liger-kernel", dict(UPSTREAM_OPS), unavailable=reason)
    harness.EXTRA_PROVIDERS[UPSTREAM] = peer
    try:
        runner = harness.Runner(cfg, harness.Hardware(**request["hardware"]), log=lambda msg: None)
        return runner.run(load_specs(tuple(request["ops"])))
    finally:
        del harness.EXTRA_PROVIDERS[UPSTREAM]


def _run_config(request: dict):
    from benchmarks import harness

    return harness.RunConfig(
        device=torch.device(request["device"]), dtype=getattr(torch, request["dtype"]),
        modes=tuple(request["modes"]), providers=(UPSTREAM,), quick=request["quick"], tiny=request["tiny"],
        max_seconds=request["max_seconds"], timing=harness.TimingConfig(**request["timing"]))


def _child_ops(request_path: str, out_path: str) -> int:
    """Child side of :func:`run_upstream_ops` (runs with the upstream package on the path)."""
    request = json.loads(Path(request_path).read_text())
    if request["device"] == "cpu":
        os.environ["TRITON_INTERPRET"] = "1"
    from benchmarks import harness
    from benchmarks.specs import load_specs

    version = check_upstream_import(request["path"])
    harness.EXTRA_PROVIDERS[UPSTREAM] = Peer(UPSTREAM, "liger_kernel", "liger-kernel", dict(UPSTREAM_OPS),
                                             version=version)
    cfg = _run_config(request)
    if cfg.device.type == "cpu":
        torch.set_num_threads(1)
    runner = harness.Runner(cfg, harness.Hardware(**request["hardware"]))
    rows = runner.run(load_specs(tuple(request["ops"])))
    Path(out_path).write_text(json.dumps([asdict(r) for r in rows]))
    return 0


def merge_speedups(rows: list) -> None:
    """``speedup_vs_hf`` of peer rows measured apart from the hf_eager row of the same case."""
    hf = {(r.op, r.shape, r.mode): r for r in rows if r.provider == "hf_eager" and r.status == "ok"}
    for r in rows:
        base = hf.get((r.op, r.shape, r.mode))
        if r.provider == UPSTREAM and r.status == "ok" and base is not None:
            r.speedup_vs_hf = base.median_ms / r.median_ms


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.peers",
                                     description="child process of the upstream Liger-Kernel provider")
    parser.add_argument("command", choices=("ops",))
    parser.add_argument("request")
    parser.add_argument("out")
    args = parser.parse_args(argv)
    return _child_ops(args.request, args.out)


if __name__ == "__main__":
    sys.exit(main())
