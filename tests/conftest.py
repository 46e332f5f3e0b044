# Imported before any test captures output: Lightning's log handler binds to the stderr of the moment it is imported
# (`import lightning_precision` no longer imports it), and one test's closed capture must not be where later
# tests' "Seed set to 0" goes.
import logging

import lightning  # noqa: F401
import pytest
import torch

from tests.cuda_kernels import refusing_what_cuda_refuses
from tests.runif import NO_CUDA, cuda_tier_device
from tests.wheel import build_wheel

_LIGHTNING_LOGGERS = ("lightning.pytorch", "lightning.fabric", "lightning_fabric", "pytorch_lightning")


def pytest_collection_modifyitems(config, items):
    """The cuda tier (marker `cuda`) skips, with its reason, where it has no device to run on (tests/runif.py)."""
    if cuda_tier_device() is None:
        skip = pytest.mark.skip(reason=NO_CUDA)
        for item in items:
            if item.get_closest_marker("cuda"):
                item.add_marker(skip)


@pytest.fixture(autouse=True)
def _own_working_directory(tmp_path_factory, monkeypatch):
    """Each test runs in a folder of its own: a Trainer's `lightning_logs`, or FP8Guard's default plan beside them,
    never lands in the checkout (or in another test's folder)."""
    monkeypatch.chdir(tmp_path_factory.mktemp("cwd"))


@pytest.fixture(autouse=True)
def _restore_logger_levels():
    """A test that quiets Lightning's loggers (as `compare`'s runs do) must not hide the next test's info lines."""
    levels = {name: logging.getLogger(name).level for name in _LIGHTNING_LOGGERS}
    yield
    for name, level in levels.items():
        logging.getLogger(name).setLevel(level)


@pytest.fixture(autouse=True)
def _restore_global_torch_state():
    """Plugins change global state (matmul precision); a test must not leak it into the next."""
    dtype, matmul = torch.get_default_dtype(), torch.get_float32_matmul_precision()
    yield
    torch.set_default_dtype(dtype)
    torch.set_float32_matmul_precision(matmul)


@pytest.fixture(autouse=True, scope="session")
def _amp_ops_refuse_what_cuda_refuses():
    """A private AMP op called with a dtype its CUDA kernel refuses fails here as on a GPU (``tests/cuda_kernels.py``)."""
    with refusing_what_cuda_refuses():
        yield


@pytest.fixture(scope="session")
def package_wheel(tmp_path_factory):
    """The package's wheel, built once per session (``tests/wheel.py``) for every test that installs it."""
    return build_wheel(tmp_path_factory)
