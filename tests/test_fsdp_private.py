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
