"""Building the Hub-kernel repository from this checkout for the tests (scripts/build_hub_kernel.py),
and keeping those tests off the network."""

from __future__ import annotations

import contextlib
import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BUILD_SCRIPT = ROOT / "scripts" / "build_hub_kernel.py"


def build_script():
    """The build script as a module (scripts/ is not a package)."""
    name = "build_hub_kernel"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, BUILD_SCRIPT)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


def build_repository(out_dir: Path) -> Path:
    """A kernel repository with the cuda and cpu variants, built into ``out_dir``."""
    build_script().build(out_dir)
    return out_dir


@contextlib.contextmanager
def hub_offline():
    """huggingface_hub, through which ``kernels`` and transformers download, in offline mode: a
    request for the Hub raises ``OfflineModeIsEnabled`` instead of reaching the network (it reads
    ``constants.HF_HUB_OFFLINE`` on each request); subprocesses inherit ``HF_HUB_OFFLINE=1``."""
    from huggingface_hub import constants

    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("HF_HUB_OFFLINE", "1")
        patch.setattr(constants, "HF_HUB_OFFLINE", True)
        yield


@pytest.fixture(scope="module", autouse=True)
def offline_hub():
    """Autouse in every test module that imports it: no test there may reach the Hub (the
    builds are local)."""
    with hub_offline():
        yield
