"""The committed ``patching/apply_functions.py`` is what ``scripts/generate_apply_functions.py``
writes from the runtime data for the installed transformers, so the two cannot drift apart."""

import importlib.util
import inspect
from pathlib import Path

import pytest

pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parents[2]


def _generator():
    spec = importlib.util.spec_from_file_location("generate_apply_functions", ROOT / "scripts/generate_apply_functions.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_committed_module_matches_the_generator():
    generator = _generator()
    assert generator.TARGET.read_text() == generator.render(), (
        "src/liger_kernel/transformers/patching/apply_functions.py is out of date: "
        "run PYTHONPATH=src python scripts/generate_apply_functions.py")


def test_written_functions_match_the_built_ones():
    """A written function has the signature and docstring the registry would build for its
    model type, and is the registry's entry wherever the installed transformers lists it."""
    from liger_kernel.transformers.patching import api, apply_functions, registry

    for model_type in api.written_model_types():
        written = getattr(apply_functions, api.apply_function_name(model_type))
        built = registry._BuiltApplyFunction(model_type)
        assert registry.MODEL_TYPE_TO_APPLY_LIGER_FN.get(model_type, written) is written
        assert inspect.signature(written) == inspect.signature(built), model_type
        assert inspect.getdoc(written) == inspect.getdoc(built), model_type


def test_package_root_imports_without_torch_or_transformers():
    """``import liger_kernel.transformers`` (and its written apply functions) loads neither
    torch nor transformers: the patching code is imported on the first call."""
    import subprocess
    import sys

    code = ("import sys, liger_kernel.transformers as lt; lt.apply_liger_kernel_to_llama; "
            "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={"PYTHONPATH": str(ROOT / "src"), "PATH": ""}).stdout
    assert out.strip() == "[]"
