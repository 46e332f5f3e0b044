"""The private torch FSDP2 names ``lightning_precision/_fsdp.py`` relies on, checked against the installed torch: if an
upstream release moves one, this fails here with the name, not deep inside a sharded run."""

import inspect

import pytest
import torch
from torch.distributed.fsdp import FSDPModule

from lightning_precision import _fsdp


def test_the_policy_is_read_through_fsdp_state():
    assert callable(getattr(FSDPModule, "_get_fsdp_state", None)), "FSDPModule._get_fsdp_state is gone: update _fsdp.py"
    from torch.distributed.fsdp._fully_shard._fsdp_state import FSDPState

    assert "_mp_policy" in inspect.getsource(FSDPState.init), "FSDPState no longer keeps _mp_policy: update _fsdp.py"


@pytest.mark.skipif(not _fsdp.custom_all_gather_supported(),
                    reason=f"torch {torch.__version__} has no FSDPModule.set_custom_all_gather (torch >= 2.8)")
def test_the_byte_all_gather_builds_on_torchs_default_all_gather():
    from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather

    comm = _fsdp.byte_all_gather()
    assert isinstance(comm, AllGather)
    assert list(inspect.signature(comm.__call__).parameters) == ["output_tensor", "input_tensor", "group", "async_op"]
    assert callable(comm.allocate)


def test_torchao_keeps_the_precomputed_scale_where_the_plugin_drops_it():
    """``Float8ScalePrecompute`` drops a stale scale where torchao's precompute writes it and its all-gather reads it:
    ``DTensor._local_tensor._precomputed_scale`` of a ``WeightWithDynamicFloat8CastTensor``."""
    fsdp_utils = pytest.importorskip("torchao.float8.fsdp_utils")
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    for fn in (fsdp_utils.precompute_float8_dynamic_scale_for_fsdp, fsdp_utils.WeightWithDynamicFloat8CastTensor.fsdp_pre_all_gather):
        source = inspect.getsource(fn)
        assert "_precomputed_scale" in source, f"{fn.__qualname__} no longer uses _precomputed_scale: update _fsdp.py"
    assert "_local_tensor" in inspect.getsource(fsdp_utils.precompute_float8_dynamic_scale_for_fsdp)
    layer = convert_to_float8_training(torch.nn.Sequential(torch.nn.Linear(16, 16)),
                                       config=Float8LinearConfig(emulate=True, enable_fsdp_float8_all_gather=True))[0]
    assert isinstance(layer.weight, fsdp_utils.WeightWithDynamicFloat8CastTensor)
    assert layer.weight._precomputed_scale is None
    version = layer.weight._version
    with torch.no_grad():
        layer.weight.mul_(2.0)
    assert layer.weight._version > version  # an in-place change moves the parameter's own counter
