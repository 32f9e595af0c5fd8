"""scripts/build_hub_kernel.py writes a kernel repository that ``kernels`` loads, bundling the ops
the layers import (found from the import graph) with relative imports."""

from __future__ import annotations

import ast
import json
import shutil
import sys

import pytest
import torch

kernels = pytest.importorskip("kernels")

from kernels._internals.digest import DigestVerificationResult, verify_digest  # noqa: E402
from kernels._internals.resolver import resolve_local_kernel  # noqa: E402
from kernels._rust import Metadata  # noqa: E402

from liger_kernel.hub.layers import LAYERS_VERSION  # noqa: E402
from tests.hub.repository import (  # noqa: E402
    build_script,
    offline_hub,  # noqa: F401 (an autouse fixture)
)
from tests.utils import DEVICE  # noqa: E402

SYSTEM_VARIANT = "torch-cuda" if torch.version.cuda else "torch-cpu"


@pytest.fixture(scope="module")
def repository(tmp_path_factory):
    out = tmp_path_factory.mktemp("hub") / "liger-kernel"
    build_script().main([str(out)])
    return out


def python_files(variant):
    return {path.relative_to(variant).as_posix(): path for path in sorted(variant.rglob("*.py"))}


def test_writes_noarch_variants_kernels_resolves_and_verifies(repository):
    variants = sorted(p.name for p in (repository / "build").iterdir())
    assert variants == ["torch-cpu", "torch-cuda"]
    ids = set()
    for name in variants:
        variant = repository / "build" / name
        metadata = Metadata.read_from_file(variant / "metadata.json")
        assert str(metadata.name) == "liger-kernel"
        assert metadata.version == LAYERS_VERSION
        assert metadata.license == "BSD-2-Clause"
        assert str(metadata.backend.backend_type).lower().endswith(name.removeprefix("torch-"))
        assert metadata.python_depends == []
        assert metadata.id.isidentifier() and metadata.id not in ids
        ids.add(metadata.id)
        # The digest covers every file; kernels checks it on each local load.
        assert isinstance(verify_digest(variant, metadata=metadata, location=None),
                          DigestVerificationResult.Success)
        assert set(json.loads((variant / "metadata.json").read_text())["digest"]["files"]) == set(python_files(variant))
    assert resolve_local_kernel(repository, backend=None).variant_path.name == SYSTEM_VARIANT
    assert "license: bsd-2-clause" in (repository / "README.md").read_text()


def test_a_changed_file_fails_the_digest(repository, tmp_path):
    copy = tmp_path / "copy"
    shutil.copytree(repository, copy)
    variant = copy / "build" / SYSTEM_VARIANT
    (variant / "layers.py").write_text((variant / "layers.py").read_text() + "\n# edited\n")
    metadata = Metadata.read_from_file(variant / "metadata.json")
    assert isinstance(verify_digest(variant, metadata=metadata, location=None),
                      DigestVerificationResult.DigestVerificationFailure)


def test_bundles_only_the_ops_the_layers_import_and_never_liger_kernel(repository):
    files = python_files(repository / "build" / SYSTEM_VARIANT)
    assert {"__init__.py", "layers.py", "ops/__init__.py", "ops/rms_norm.py", "ops/rope.py", "ops/swiglu.py",
            "ops/geglu.py"} <= set(files)
    # The losses are not used by any layer.
    assert not {"ops/cross_entropy.py", "ops/fused_linear_cross_entropy.py", "ops/chunked_head.py"} & set(files)
    for name, path in files.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                assert all(alias.name.split(".")[0] in {"torch", "triton"} or alias.name.split(".")[0]
                           in sys.stdlib_module_names for alias in node.names), (name, node.lineno)
            elif isinstance(node, ast.ImportFrom) and not node.level:
                assert node.module.split(".")[0] in {"__future__", "torch", "triton"} | set(sys.stdlib_module_names), \
                    (name, node.lineno, node.module)
            assert not (isinstance(node, ast.Name) and node.id == "liger_kernel"), (name, node.lineno)


def test_the_build_and_liger_kernel_run_side_by_side(repository):
    """The bundled custom ops live in the build's own torch.library namespace, so importing
    liger_kernel in the same process registers nothing twice; both compute the same norm."""
    from liger_kernel.ops.rms_norm import LigerRMSNormFunction

    kernel = kernels.get_local_kernel(repository)
    metadata = Metadata.read_from_file(repository / "build" / SYSTEM_VARIANT / "metadata.json")
    assert kernel.__name__ == metadata.id
    bundled = sys.modules[f"{metadata.id}.ops.rms_norm"].LigerRMSNormFunction
    assert bundled is not LigerRMSNormFunction
    x = torch.randn(5, 48, device=DEVICE)
    w = torch.randn(48, device=DEVICE)
    torch.testing.assert_close(bundled.apply(x, w, 1e-6, 0.0, "llama", False),
                               LigerRMSNormFunction.apply(x, w, 1e-6, 0.0, "llama", False), atol=0, rtol=0)
    namespace = metadata.id.lstrip("_")
    assert hasattr(getattr(torch.ops, namespace), "rms_norm_forward")
    assert hasattr(torch.ops.liger, "rms_norm_forward")


@pytest.fixture
def source_copy(tmp_path, monkeypatch):
    """A copy of src/liger_kernel the build reads instead of the checkout's."""
    script = build_script()
    src = tmp_path / "src"
    shutil.copytree(script.SRC / "liger_kernel", src / "liger_kernel",
                    ignore=shutil.ignore_patterns("__pycache__", "transformers", "chunked_loss"))
    monkeypatch.setattr(script, "SRC", src)
    return src / "liger_kernel"


def test_follows_the_import_graph_into_a_new_ops_module(source_copy, tmp_path):
    (source_copy / "ops" / "rounding_helpers.py").write_text(
        '"""A helper module the build has never seen."""\n\nfrom liger_kernel.ops.numerics import round_to_dtype\n\n'
        "HELPER = round_to_dtype\n")
    rope = source_copy / "ops" / "rope.py"
    # An import inside a function body is part of the graph too.
    rope.write_text(rope.read_text() + "\n\ndef _helper():\n    from liger_kernel.ops.rounding_helpers import HELPER\n"
                    "\n    return HELPER\n")
    (variant,) = build_script().build(tmp_path / "out", ("cpu",))
    assert "from .numerics import round_to_dtype" in (variant / "ops" / "rounding_helpers.py").read_text()
    assert "    from .rounding_helpers import HELPER\n" in (variant / "ops" / "rope.py").read_text()


@pytest.mark.parametrize("statement, message", [
    ("from liger_kernel.transformers.families import FAMILIES", "may bundle only liger_kernel.ops"),
    ("import requests", "may import only the standard library"),
    ("import liger_kernel.ops.rope", "instead of `import liger_kernel.ops.rope`"),
    ("from liger_kernel.ops import LigerRopeFunction", "not from liger_kernel.ops itself"),
])
def test_refuses_imports_a_kernel_cannot_have(source_copy, tmp_path, statement, message):
    layers = source_copy / "hub" / "layers.py"
    layers.write_text(layers.read_text().replace("import torch\n", f"import torch\n{statement}\n", 1))
    script = build_script()
    with pytest.raises(script.BuildError, match=message):
        script.build(tmp_path / "out", ("cpu",))


def test_refuses_unknown_backends(tmp_path):
    script = build_script()
    with pytest.raises(script.BuildError, match="backends"):
        script.build(tmp_path, ("tpu",))


def test_a_fresh_process_runs_the_build_without_importing_liger_kernel(repository):
    import os
    import subprocess

    code = (
        "import sys\nfrom pathlib import Path\nimport torch, kernels\n"
        f"kernel = kernels.get_local_kernel(Path({str(repository)!r}))\n"
        "ops = sys.modules[kernel.__name__ + '.ops.rms_norm']\n"
        f"x = torch.randn(3, 16, device={DEVICE!r})\n"
        "y = ops.LigerRMSNormFunction.apply(x, torch.ones(16, device=x.device), 1e-6, 0.0, 'llama', False)\n"
        "reference = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)\n"
        "torch.testing.assert_close(y, reference)\n"
        "loaded = sorted(m for m in sys.modules if m.split('.')[0] == 'liger_kernel')\n"
        "assert not loaded, loaded\n"
    )
    env = dict(os.environ)
    if DEVICE == "cpu":
        env["TRITON_INTERPRET"] = "1"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
