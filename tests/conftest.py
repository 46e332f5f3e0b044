# Imported before any test captures output: Lightning's log handler binds to the stderr of the moment it is imported
# (`import lightning_precision` no longer imports it), and one test's closed capture must not be where later
# tests' "Seed set to 0" goes.
import lightning  # noqa: F401
import pytest
import torch


@pytest.fixture(autouse=True)
def _restore_global_torch_state():
    """Plugins change global state (matmul precision); a test must not leak it into the next."""
    dtype, matmul = torch.get_default_dtype(), torch.get_float32_matmul_precision()
    yield
    torch.set_default_dtype(dtype)
    torch.set_float32_matmul_precision(matmul)
