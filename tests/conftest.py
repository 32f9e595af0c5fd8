"""Pick how the kernels run: compiled on a GPU, or through Triton's CPU interpreter.

``TRITON_INTERPRET`` must be set before triton is first imported, so this runs before any
test module imports ``liger_kernel``. Without CUDA, every test runs the real kernels on CPU
tensors through the interpreter with the small shape set; with CUDA, compiled on the GPU
with the full shape set (``LIGER_TEST_SHAPES=small|full`` overrides either default).
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

import pytest

from tests.utils import DEVICE, FULL_SHAPES


def pytest_report_header(config):
    mode = "compiled on CUDA" if DEVICE == "cuda" else "Triton interpreter on CPU"
    return f"liger_kernel tests: {mode}, {'full' if FULL_SHAPES else 'small'} shape set"


def pytest_collection_modifyitems(config, items):
    if DEVICE == "cuda":
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu_only" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _fresh_seed(request):
    # A different seed per test run keeps inputs fresh; a failure's report names it (see
    # pytest_runtest_makereport), and LIGER_TEST_SEED=<seed> replays it.
    replay = os.environ.get("LIGER_TEST_SEED")
    seed = int(replay) if replay else int.from_bytes(os.urandom(4), "little")
    request.node.liger_test_seed = seed
    torch.manual_seed(seed)
    yield seed


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    report = yield
    seed = getattr(item, "liger_test_seed", None)
    if report.failed and seed is not None:
        report.sections.append(("random seed", f"replay with LIGER_TEST_SEED={seed}"))
    return report
