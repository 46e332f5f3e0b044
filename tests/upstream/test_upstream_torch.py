"""Canaries of the private torch names in ``lightning_precision/_upstream/torch.py`` and of the ``GradScaler`` state
``_core/scaling/scaler.py``'s subclass uses: each exercises the behaviour the package relies on against the installed torch,
so that an upstream change fails here, with the name, not deep inside a sharded run or as a wrong loss scale."""

import pytest
import torch
from torch import nn
from torch.amp.grad_scaler import OptState

from lightning_precision._core import fsdp
from lightning_precision._upstream import torch as upstream


def test_the_fused_check_finds_inf_and_nan_per_group_and_unscales():
    found = torch.zeros(())
    grads = [torch.tensor([2.0, 4.0]), torch.tensor([8.0])]
    upstream.non_finite_check_and_unscale_(grads, found, torch.tensor(0.5))
    assert found.item() == 0 and grads[0].tolist() == [1.0, 2.0] and grads[1].tolist() == [4.0]
    for bad in (float("inf"), float("nan")):
        found = torch.zeros(())
        upstream.non_finite_check_and_unscale_([torch.tensor([1.0, bad])], found, torch.ones(()))
        assert found.item() == 1


def test_the_foreach_infinity_norm_propagates_nan_and_refuses_an_empty_tensor():
    """The check of bf16 gradients rests on ``torch._foreach_norm(..., inf)``: nan where a value is nan (not the
    largest other value), inf where one is inf; an empty tensor it refuses on the CPU (the check leaves those out)."""
    norms = torch._foreach_norm([torch.tensor([1.0, float("nan"), 3.0], dtype=torch.bfloat16),
                                 torch.tensor([-float("inf"), 2.0], dtype=torch.bfloat16)], float("inf"))
    assert norms[0].isnan() and norms[1].item() == float("inf") and norms[0].dtype == torch.bfloat16
    with pytest.raises(RuntimeError, match="empty tensor"):
        torch._foreach_norm([torch.empty(0)], float("inf"))


def test_torchs_scaler_checks_gradients_in_unscale_grads_alone():
    """``_unscale_grads_(optimizer, inv_scale, found_inf, allow_fp16)`` is where torch's scaler checks (and unscales)
    gradients, from ``unscale_`` (fp16 refused) and before a fused optimizer's step (fp16 allowed, scale 1): the one
    method the package's scaler overrides, so that bf16 gradients never reach a kernel that refuses them on CUDA."""
    calls = []

    class Seeing(torch.amp.GradScaler):
        def _unscale_grads_(self, optimizer, inv_scale, found_inf, allow_fp16):
            calls.append((inv_scale.item(), found_inf.item(), allow_fp16))
            return super()._unscale_grads_(optimizer, inv_scale, found_inf, allow_fp16)

    for fused in (False, True):
        param = nn.Parameter(torch.ones(2))
        scaler = Seeing("cpu", init_scale=4.0)
        optimizer = torch.optim.Adam([param], fused=fused)
        scaler.scale(param.sum()).backward()
        scaler.step(optimizer)
        scaler.update()
    assert calls == [(0.25, 0.0, False), (1.0, 0.0, True)]


def test_sparse_values_of_an_uncoalesced_gradient():
    grad = torch.sparse_coo_tensor([[0, 0]], [1.0, float("inf")], (3,))  # index 0 twice: not coalesced
    assert not grad.is_coalesced()
    assert upstream.sparse_values(grad).tolist() == [1.0, float("inf")]


def test_the_version_counter_moves_on_an_in_place_change():
    weight = nn.Linear(2, 2).weight
    version = upstream.version_counter(weight)
    with torch.no_grad():
        weight.mul_(2.0)
    assert upstream.version_counter(weight) > version


def test_the_grad_scalers_state_the_subclass_uses():
    """``_init_scale`` before the first scale, ``_scale`` and ``_growth_tracker`` after, ``_per_optimizer_states`` with
    each optimizer's stage and ``found_inf_per_device``, ``_enabled``: as ``TrackingGradScaler`` reads them."""
    scaler = torch.amp.GradScaler("cpu", init_scale=8.0, growth_interval=1)
    assert scaler._enabled and scaler._scale is None and scaler._init_scale == 8.0
    assert upstream.grad_scaler_scale(scaler).item() == 8.0
    param = nn.Parameter(torch.ones(2))
    optimizer = torch.optim.SGD([param], lr=0.1)
    scaler.scale(param.sum()).backward()
    scaler.step(optimizer)
    state = scaler._per_optimizer_states[id(optimizer)]
    assert state["stage"] is OptState.STEPPED
    assert [f.item() for f in state["found_inf_per_device"].values()] == [0.0]
    scaler.update()
    assert upstream.grad_scaler_scale(scaler).item() == 16.0 and scaler._scale.item() == 16.0  # grew
    assert scaler._growth_tracker.item() == 0 and not scaler._per_optimizer_states  # update forgets the flags
    scaler._init_growth_tracker = 0  # what load_state_dict sets before the first scale
    assert not torch.amp.GradScaler("cpu", enabled=False)._enabled


@pytest.mark.skipif(not hasattr(torch, "xpu"), reason="this torch has no torch.xpu")
def test_xpu_is_compiled_answers_a_bool():
    assert upstream.xpu_is_compiled() in (True, False)
    if upstream.xpu_is_compiled():
        assert torch.xpu.device_count() >= 0
    else:
        assert not torch.xpu.is_available()


def test_the_policy_a_module_was_sharded_with_is_read_back(tmp_path):
    """One gloo process: ``fully_shard`` with a policy, read back through the FSDP state."""
    import torch.distributed as dist
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'rdzv'}", rank=0, world_size=1)
    try:
        model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        fully_shard(model[0], mp_policy=policy)
        fully_shard(model)
        assert upstream.fsdp_mp_policy(model[0]) == policy
        assert upstream.fsdp_mp_policy(model).param_dtype is None
        assert dict(fsdp.gather_dtypes(model)) == {"0": torch.bfloat16, "<root>": torch.float32}
        local = upstream.dtensor_local_tensor(model[0].weight)
        assert local is upstream.dtensor_local_tensor(model[0].weight)  # the same object each time, unlike to_local()
        assert local.shape == model[0].weight.to_local().shape
    finally:
        dist.destroy_process_group()


@pytest.mark.skipif(not fsdp.custom_all_gather_supported(),
                    reason=f"torch {torch.__version__} has no FSDPModule.set_custom_all_gather (torch >= 2.8)")
def test_the_byte_all_gather_gathers_float8_as_bytes(tmp_path):
    """The default all-gather subclassed: one gloo process gathers a float8 tensor (gloo has no float8) bit-exactly."""
    import torch.distributed as dist
    from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather

    comm = fsdp.byte_all_gather()
    assert isinstance(comm, AllGather) and issubclass(type(comm), upstream.byte_all_gather_base())
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'rdzv'}", rank=0, world_size=1)
    try:
        data = torch.tensor([0.5, -2.0, 448.0]).to(torch.float8_e4m3fn)
        out = comm.allocate((3,), dtype=torch.float8_e4m3fn, device=torch.device("cpu"))
        work = comm(out, data, dist.group.WORLD)
        if work is not None:
            work.wait()
        assert torch.equal(out.view(torch.uint8), data.view(torch.uint8))
    finally:
        dist.destroy_process_group()


def test_torchao_keeps_no_precomputed_scale_on_a_fresh_fp8_weight():
    """``Float8ScalePrecompute`` drops a stale scale where torchao's precompute writes it (``_precomputed_scale`` of a
    ``WeightWithDynamicFloat8CastTensor``); the drop itself is exercised sharded in test_fsdp.py."""
    fsdp_utils = pytest.importorskip("torchao.float8.fsdp_utils")
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    layer = convert_to_float8_training(nn.Sequential(nn.Linear(16, 16)),
                                       config=Float8LinearConfig(emulate=True, enable_fsdp_float8_all_gather=True))[0]
    assert isinstance(layer.weight, fsdp_utils.WeightWithDynamicFloat8CastTensor)
    assert layer.weight._precomputed_scale is None


def test_a_call_inside_a_compiled_module_is_seen_also_when_it_runs_eagerly():
    """``inside_compiled_call`` finds dynamo's wrapper on the stack: when compiled code runs under the ``force_eager``
    stance (how measuring runs it), and not for the same module uncompiled."""
    seen = []

    class Probe(torch.nn.Module):
        def forward(self, x):
            seen.append(upstream.inside_compiled_call())
            return x + 1

    module = Probe()
    module(torch.ones(2))
    compiled = torch.compile(module, backend="eager")
    with torch.compiler.set_stance("force_eager"):
        compiled(torch.ones(2))
    torch._dynamo.reset()
    assert seen == [False, True]


def test_the_optimizer_step_hooks_are_where_they_are_read_and_run_in_that_order():
    from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

    from lightning_precision._upstream.torch import optimizer_step_hooks

    weight = torch.nn.Parameter(torch.ones(2))
    optimizer = torch.optim.SGD([weight], lr=0.1)
    calls: list[str] = []
    handles = [register_optimizer_step_pre_hook(lambda *a: calls.append("global pre")),
               optimizer.register_step_pre_hook(lambda *a: calls.append("pre")),
               optimizer.register_step_post_hook(lambda *a: calls.append("post")),
               register_optimizer_step_post_hook(lambda *a: calls.append("global post"))]
    try:
        pre, post = optimizer_step_hooks(optimizer)
        # (the global dicts may hold hooks of others too, e.g. a true-precision plugin's)
        assert len(pre[1]) == len(post[0]) == 1 and len(pre[0]) >= 1 and len(post[1]) >= 1
        weight.grad = torch.ones(2)
        optimizer.step()
        assert calls == ["global pre", "pre", "post", "global post"]
        held = [dict(h) for h in pre + post]
        for hooks in pre + post:
            hooks.clear()  # what the true step does while it steps chunk by chunk
        calls.clear()
        optimizer.step()
        assert calls == []  # cleared there, torch runs none
        for hooks, kept in zip(pre + post, held, strict=True):
            hooks.update(kept)
    finally:
        for handle in handles:
            handle.remove()


def test_the_dispatch_counter_sees_each_aten_op_and_each_host_read():
    """``TorchDispatchMode`` (private module ``torch.utils._python_dispatch``): every aten op of the block, and a read
    on the host as ``aten._local_scalar_dense`` with the tensor's device."""
    x = torch.ones(3)
    with upstream.DispatchCounter() as counter:
        y = (x * 2).sum()
        float(y)
    assert counter.names == ["aten.mul.Tensor", "aten.sum.default", upstream.DispatchCounter.HOST_READ]
    assert counter.host_reads == counter.reads_on("cpu") == 1 and counter.reads_on("cuda") == 0


def test_the_dispatch_counter_counts_tolist_as_one_read_and_puts_it_back():
    """``tolist()`` reads every value in one go and dispatches no aten op on a CPU tensor: the counter wraps it while
    active (one read a call, a subclass's included; nested counters each count it) and puts torch's own back, after
    an exception too."""

    class Sub(torch.Tensor):
        pass

    before = torch.Tensor.tolist
    x, sub = torch.arange(3.0), torch.arange(3.0).as_subclass(Sub)
    with upstream.DispatchCounter() as outer:
        x.tolist()
        with upstream.DispatchCounter() as inner:
            assert sub.tolist() == [0.0, 1.0, 2.0]
    assert (outer.host_reads, inner.host_reads) == (2, 1)
    with pytest.raises(KeyError), upstream.DispatchCounter():
        raise KeyError("inside")
    assert torch.Tensor.tolist is before and "tolist" not in torch.Tensor.__dict__


def test_the_foreach_list_ops_the_true_step_relies_on():
    """``torch._foreach_copy_`` converts dtypes into existing tensors, ``_foreach_mul`` copies every bit (-0.0, NaN),
    ``_foreach_mul_`` takes a 0-dim tensor, ``_foreach_norm`` takes ``dtype=`` (an fp16 norm at a loss scale would
    overflow) and ``inf``: each a single op, as the true-precision step counts them."""
    from lightning_precision._upstream.torch import (
        DispatchCounter,
        foreach_copy_,
        foreach_mul,
        foreach_mul_,
        foreach_norm,
    )

    sources = [torch.tensor([1.5, -2.0], dtype=torch.bfloat16), torch.tensor([[3.0]], dtype=torch.bfloat16)]
    targets = [torch.zeros(2), torch.zeros(1, 1)]
    with DispatchCounter() as counter:
        foreach_copy_(targets, sources)
    assert counter.names == ["aten._foreach_copy_.default"]
    assert targets[0].tolist() == [1.5, -2.0] and targets[1].dtype == torch.float32 and targets[1].item() == 3.0
    special = [torch.tensor([-0.0, float("nan"), 7.0])]
    copied = foreach_mul(special, 1)
    assert copied[0] is not special[0]
    assert torch.equal(copied[0].view(torch.int32), special[0].view(torch.int32))
    scaled = [torch.tensor([2.0, 4.0], dtype=torch.float16)]
    foreach_mul_(scaled, torch.tensor(0.5))
    assert scaled[0].tolist() == [1.0, 2.0] and scaled[0].dtype == torch.float16
    big = [torch.full((4,), 60000.0, dtype=torch.float16)]
    norm = foreach_norm(big, 2.0, dtype=torch.float32)[0]
    assert norm.dtype == torch.float32 and norm.item() == pytest.approx(120000.0)
    assert foreach_norm([torch.tensor([-3.0, 2.0])], float("inf"))[0].item() == 3.0
