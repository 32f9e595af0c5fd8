"""Compile, for an H100 (sm_90a) and without a GPU, every kernel specialisation the CPU tests launch.

Triton's interpreter runs the kernels' Python on CPU tensors, so the CPU suite proves them exact
but never lowers them: a kernel can pass every interpreted test and still fail to compile
(a ``tl.dot`` below 16 rows, a type clash between two constexpr branches, a block the compiled
path refuses). This script closes that gap without a device, in two steps:

1. ``record``: run pytest on the given tests under the interpreter, noting each distinct launch:
   the kernel, its runtime arguments' Triton types (``*bf16``, ``i32``, ``fp32``, ...), its
   constexpr values and ``num_warps`` / ``num_stages``.
2. ``compile`` (a fresh process, interpreter off): ``triton.compile`` each recorded launch for
   ``cuda`` capability 90 down to a cubin (Triton lowers to PTX and assembles it with the ptxas
   it bundles); a failure at any stage is reported with the launch that caused it. A launch recorded with
   ``ROUND_BY_HAND=True`` (the interpreter's rounding) is compiled with ``False`` too, the
   branch the GPU runs; tile sizes and warps stay the interpreter's. Worker processes compile;
   a compiler crash (a signal) fails the launch it was on, and the rest go on.

It proves compilation only, not the compiled kernels' numbers (that takes the GPU suite), and
it compiles with the local Triton, which may be newer than the GPU image's.

Usage (from the repository root, with ``PYTHONPATH=src`` or the package installed)::

    python scripts/compile_check.py [--launches FILE] [--jobs N] [PYTEST_ARGS ...]
    python scripts/compile_check.py tests/ops -k "not huge"        # the ops' tests' launches
    python scripts/compile_check.py record FILE tests/ops/test_swiglu.py
    python scripts/compile_check.py compile FILE

Kernels of modules named ``liger_kernel.*`` are recorded (``LIGER_COMPILE_CHECK_MODULES=prefix``
names others). Exit status: 0 when every launch compiled, 1 when one failed, 2 when recording
failed.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TARGET_CAPABILITY = 90


def _launch_key(fn, args: tuple, kwargs: dict) -> str | None:
    """One launch as JSON: kernel, runtime argument types, constexprs, options (None when an
    argument has no Triton type, e.g. a kernel called from another one's Python)."""
    import inspect

    import triton.runtime.jit as jit

    options = {name: kwargs.pop(name) for name in ("num_warps", "num_stages") if name in kwargs}
    bound = inspect.signature(fn).bind(*args, **kwargs)
    bound.apply_defaults()
    constexpr_names = {name for name, p in inspect.signature(fn).parameters.items()
                       if "constexpr" in str(p.annotation)}
    signature, constexprs = {}, {}
    for name, value in bound.arguments.items():
        if name in constexpr_names or value is None:
            if not isinstance(value, (bool, int, float, str, type(None))):
                value = str(value)  # a tl.dtype given as a constexpr
            constexprs[name] = value
            signature[name] = "constexpr"
        else:
            try:
                signature[name] = jit.mangle_type(value)
            except Exception:
                return None
    return json.dumps({"module": fn.__module__, "kernel": fn.__name__, "signature": signature,
                       "constexprs": constexprs, "options": options}, sort_keys=True)


def record(out: Path, pytest_args: list[str], module_prefix: str = "liger_kernel.") -> int:
    """Run pytest under the interpreter and write the distinct launches of kernels defined in
    modules named ``module_prefix...`` to ``out`` (JSON lines)."""
    os.environ["TRITON_INTERPRET"] = "1"
    import pytest
    from triton.runtime.interpreter import InterpretedFunction

    launches: set[str] = set()
    original_run = InterpretedFunction.run

    def recording_run(self, *args, grid, warmup, **kwargs):
        key = _launch_key(self.fn, args, dict(kwargs))
        if key is not None and self.fn.__module__.startswith(module_prefix):
            launches.add(key)
        return original_run(self, *args, grid=grid, warmup=warmup, **kwargs)

    InterpretedFunction.run = recording_run
    try:
        status = pytest.main(["-q", "-p", "no:cacheprovider", "-n", "0", *pytest_args])
    finally:
        InterpretedFunction.run = original_run
    out.write_text("".join(line + "\n" for line in sorted(launches)))
    print(f"recorded {len(launches)} distinct launches into {out}", flush=True)
    # A failing test still recorded its launches (the suite judges the tests); no launch at all,
    # or pytest unable to run (usage error, no tests collected), fails the recording.
    return 0 if launches and status in (pytest.ExitCode.OK, pytest.ExitCode.TESTS_FAILED) else 2


def compile_launch(line: str) -> str | None:
    """Compile one recorded launch; None on success, else what failed."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    launch = json.loads(line)
    kernel = getattr(importlib.import_module(launch["module"]), launch["kernel"])
    source = ASTSource(fn=kernel, signature=launch["signature"], constexprs=launch["constexprs"])
    try:
        compiled = triton.compile(source, target=GPUTarget("cuda", TARGET_CAPABILITY, 32), options=launch["options"])
    except Exception as exc:
        return f"triton.compile: {type(exc).__name__}: {str(exc)[-2000:]}"
    return None if compiled.asm.get("cubin") else "triton.compile returned no cubin"


def _describe(line: str) -> str:
    launch = json.loads(line)
    return f"{launch['module']}.{launch['kernel']} {launch['constexprs']} {launch['options']}"


def with_compiled_rounding(lines: list[str]) -> list[str]:
    """``lines`` plus, for each launch recorded with ``ROUND_BY_HAND=True`` (the interpreter's
    explicit bf16/fp16 rounding of stored values), the same launch with ``False``, the branch the
    GPU runs."""
    out = dict.fromkeys(lines)
    for line in lines:
        launch = json.loads(line)
        if launch["constexprs"].get("ROUND_BY_HAND") is True:
            launch["constexprs"]["ROUND_BY_HAND"] = False
            out.setdefault(json.dumps(launch, sort_keys=True))
    return list(out)


def _compile_share(launches: Path, indices: list[int]) -> dict[int, str | None]:
    """Compile the launches at ``indices`` (lines of ``launches``) in a worker process; a compiler
    crash (a signal, not an exception) is charged to the launch it was on, and a fresh worker takes
    the rest."""
    results: dict[int, str | None] = {}
    pending = list(indices)
    while pending:
        proc = subprocess.run([sys.executable, str(Path(__file__).resolve()), "compile-worker", str(launches),
                               ",".join(map(str, pending))], capture_output=True, text=True)
        for line in proc.stdout.splitlines():
            if line.startswith("RESULT "):
                index, payload = line[len("RESULT "):].split(" ", 1)
                results[int(index)] = json.loads(payload)
        pending = [i for i in pending if i not in results]
        if pending:
            reason = (f"the compiler crashed (exit code {proc.returncode})" if proc.returncode
                      else "the worker stopped early") + f": {proc.stderr.strip()[-500:]}"
            results[pending.pop(0)] = reason
    return results


def compile_worker(launches: Path, indices: list[int]) -> int:
    lines = launches.read_text().splitlines()
    for index in indices:
        print(f"RESULT {index} {json.dumps(compile_launch(lines[index]))}", flush=True)
    return 0


def compile_all(path: Path, jobs: int) -> int:
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        print("compile: unset TRITON_INTERPRET (the interpreter replaces the kernels to compile)", file=sys.stderr)
        return 2
    lines = with_compiled_rounding([line for line in path.read_text().splitlines() if line.strip()])
    with tempfile.TemporaryDirectory() as tmp:
        expanded = Path(tmp) / "launches.jsonl"
        expanded.write_text("".join(line + "\n" for line in lines))
        shares = [list(range(k, len(lines), jobs)) for k in range(jobs)]
        results: dict[int, str | None] = {}
        with ThreadPoolExecutor(max_workers=jobs) as pool:
            for part in pool.map(lambda share: _compile_share(expanded, share), shares):
                results.update(part)
    failures = [(lines[i], results[i]) for i in range(len(lines)) if results[i] is not None]
    kernels = {tuple(json.loads(line)[k] for k in ("module", "kernel")) for line in lines}
    import triton

    print(f"compiled {len(lines) - len(failures)} of {len(lines)} launches ({len(kernels)} kernels) "
          f"for sm_{TARGET_CAPABILITY}a with Triton {triton.__version__}")
    for line, why in failures:
        print(f"FAILED {_describe(line)}\n  {why}")
    return 1 if failures else 0


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["record"]:
        prefix = os.environ.get("LIGER_COMPILE_CHECK_MODULES", "liger_kernel.")
        return record(Path(argv[1]), argv[2:], prefix)
    if argv[:1] == ["compile-worker"]:
        return compile_worker(Path(argv[1]), [int(i) for i in argv[2].split(",") if i])
    if argv[:1] == ["compile"]:
        p = argparse.ArgumentParser(prog="compile_check.py compile")
        p.add_argument("launches", type=Path)
        p.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
        args = p.parse_args(argv[1:])
        return compile_all(args.launches, args.jobs)
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--launches", type=Path, default=None, help="keep the recorded launches in this file")
    p.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    args, pytest_args = p.parse_known_args(argv)
    launches = args.launches or Path(tempfile.mkdtemp()) / "launches.jsonl"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO / "src"), str(REPO),
                                                                    os.environ.get("PYTHONPATH")])))
    script = str(Path(__file__).resolve())
    status = subprocess.run([sys.executable, script, "record", str(launches), *(pytest_args or ["tests/ops"])],
                            cwd=REPO, env=env).returncode
    if status != 0:
        return 2
    env.pop("TRITON_INTERPRET", None)
    return subprocess.run([sys.executable, script, "compile", str(launches), "--jobs", str(args.jobs)],
                          cwd=REPO, env=env).returncode


if __name__ == "__main__":
    sys.exit(main())
