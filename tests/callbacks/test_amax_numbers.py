"""AmaxHistoryLogger's numbers on edge tensors, step by step, against a straightforward reference written from the
logger's behaviour before its what-if was pooled: amax histories, delayed scales and every logged metric equal
exactly. The what-if is measured per layer in the reference, on the same sample (every element where a tensor kind's
layers fit in ``what_if_sample``); the sampled estimate is checked against the exact figure within a stated bound.

Every measured tensor is crafted (no matmul feeds what is measured: independent layers, each fed its own input and
given its own output gradient), so the expected values are the same on every machine."""

import math

import pytest
import torch
from torch import nn

from lightning_precision._amax_stats import shared_sample
from lightning_precision.callbacks import AmaxHistoryLogger
from lightning_precision.formats import FORMATS
from lightning_precision.functional import delayed_scale, multi_format_stats, multi_scale_stats

TENSORS = ("input", "weight", "grad_output")
FMT = {"input": "e4m3fn", "weight": "e4m3fn", "grad_output": "e5m2"}
FP8_MAX = torch.tensor([448.0, 448.0, 57344.0])

# Edge values: zeros, subnormals of fp32 / bf16 / fp16 / e4m3 / e5m2, values at and around the fp8 flush bounds and
# maxima, large finite values; inf, -inf and nan are put in on chosen steps.
EDGES = [0.0, 1e-45, 1e-40, 2.0**-133, 2.0**-24, 2.0**-25, 2.0**-9, 2.0**-10, 2.0**-16, 2.0**-17, 2.0**-18, 448.0,
         464.0, 480.0, 57344.0, 61440.0, 1e30, -3.0, -2.0**-10, 1.0]


class Parallel(nn.Module):
    """Independent layers (fp32, bf16, fp16; one called twice per step; one idle on some steps; one never run)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a = nn.Linear(48, 40)
        self.b = nn.Linear(64, 32).to(torch.bfloat16)
        self.c = nn.Linear(96, 24).to(torch.float16)
        self.idle = nn.Linear(8, 8)
        self.never = nn.Linear(4, 4)


def crafted(shape, step, salt, dtype=torch.float32):
    """Random values with the edge values planted, their magnitudes moved by step so that windows differ."""
    g = torch.Generator().manual_seed(1000 * step + salt)
    t = torch.randn(shape, generator=g) * 2.0 ** ((step * 7 + salt) % 13 - 6)
    flat = t.view(-1)
    idx = torch.randperm(flat.numel(), generator=g)[: len(EDGES)]
    flat[idx] = torch.tensor(EDGES) * (2.0 ** (step % 3 - 1))
    return t.to(dtype)


def special(t, step, salt):
    """inf, -inf or nan on chosen steps."""
    if (step + salt) % 5 == 3:
        t.view(-1)[1] = math.inf
    if (step + salt) % 7 == 4:
        t.view(-1)[2] = -math.inf
    if (step + salt) % 6 == 5:
        t.view(-1)[3] = math.nan
    return t


class Recorder:
    """Each step's tensors, taken by the test itself as it feeds them (the reference's inputs)."""

    def __init__(self):
        self.step = {}

    def add(self, layer, tensor, t):
        t = t.detach().clone()
        seen = self.step.setdefault(layer, {}).setdefault(tensor, [])
        seen.append(t)


def run_step(model, logger, rec, step, log):
    logger.capturing(log)
    outs, grads = [], []
    feeds = [("a", model.a, 48, 1, torch.float32), ("a", model.a, 48, 2, torch.float32),
             ("b", model.b, 64, 3, torch.bfloat16), ("c", model.c, 96, 4, torch.float16)]
    if step % 4 != 1:
        feeds.append(("idle", model.idle, 8, 5, torch.float32))
    with torch.no_grad():  # the weights change between steps only, as under an optimizer
        for salt, layer in enumerate((model.a, model.b, model.c, model.idle)):
            layer.weight.copy_(special(crafted(layer.weight.shape, step, 10 + salt, layer.weight.dtype), step, 20 + salt))
    for name, layer, width, salt, dtype in feeds:
        x = special(crafted((6, width), step, salt, dtype), step, salt)
        out = layer(x)
        g = special(crafted(out.shape, step, 30 + salt, dtype), step, 40 + salt)
        outs.append(out), grads.append(g)
        rec.add(name, "input", x)
        rec.add(name, "weight", layer.weight)
        rec.add(name, "grad_output", g)
    if step % 4 == 1:  # no tokens reach it: an empty input (and an empty output gradient)
        out = model.idle(torch.zeros(0, 8))
        outs.append(out), grads.append(torch.zeros_like(out))
        rec.add("idle", "weight", model.idle.weight)
    torch.autograd.backward(outs, grads)
    model.zero_grad(set_to_none=True)
    return logger.end_step(log)


def amax_of(ts):
    """The step's amax of one tensor kind of one layer over all its calls (nan if any element was nan), 0 if none."""
    ts = [t for t in ts if t.numel()]
    if not ts:
        return torch.tensor(0.0)
    per_call = torch.stack([t.abs().amax().float() for t in ts])
    return per_call.amax()  # nan propagates


def reference_what_if(rec, layers, current, delayed, sample, block_formats):
    """Per layer (as before the pooling): both scales and each block format measured on each layer's part of the
    sample on its own, counts summed over layers, fractions from the sums."""
    jit = delayed_scale(current, FP8_MAX, 0)
    out = {}
    for k, tensor in enumerate(TENSORS):
        rows, tensors = [], []
        for i, layer in enumerate(layers):
            ts = rec.get(layer, {}).get(tensor)
            if ts:
                # a layer called twice keeps the tensor of its last hook call: the last forward's input and weight, the
                # first forward's output gradient (the backward runs the later call first)
                rows.append(i), tensors.append(ts[0 if tensor == "grad_output" else -1])
        if not rows:
            continue
        parts = list(zip(rows, shared_sample(tensors, [t.numel() for t in tensors], sample), strict=True))
        per_kind = {}
        for kind, scales in (("delayed", delayed), ("current", jit)):
            stats = [multi_scale_stats(p.float(), FMT[tensor], [scales[i, k]])[0] for i, p in parts]
            per_kind[kind] = sum_stats(stats)
        for f in block_formats:
            per_kind[f] = sum_stats([multi_format_stats(p, (f,), tensor_amax=current[i, k])[f] for i, p in parts])
        for kind, stats in per_kind.items():
            out[f"precision/fp8_whatif/{tensor}/{kind}/underflow"] = stats.underflow_fraction
            out[f"precision/fp8_whatif/{tensor}/{kind}/overflow"] = stats.overflow_fraction
    return out


def sum_stats(stats):
    total = stats[0]
    for s in stats[1:]:
        total = total + s
    return total


def same(a, b):
    a, b = torch.as_tensor(a).double(), torch.as_tensor(b).double()
    return bool(((a == b) | (a.isnan() & b.isnan())).all())


@pytest.mark.parametrize(("history_len", "algo", "margin", "sample", "block_formats", "chunk"), [
    (3, "max", 0, None, ("mxfp8", "nvfp4"), None),
    (3, "max", 0, None, ("mxfp8", "nvfp4"), 64),  # measured 64 elements at a time, as a pool above 2**20 is
    (4, "most_recent", 1, None, ("mxfp8_floor",), None),
    (2, "max", 0, 256, ("mxfp8", "nvfp4"), None),  # sampled: 256 elements of each kind shared by the layers
    (5, "max", 2, 2**16, (), 96),
])
# The weights' amaxes: one `aminmax` each where ops are cheap (a CPU), one `_foreach_norm(inf)` for all on an
# accelerator: the same numbers (nan and inf weights included).
@pytest.mark.parametrize("ops_cheap", [True, False], ids=["cpu-policy", "accelerator-policy"])
def test_history_scales_and_every_metric_equal_the_reference(history_len, algo, margin, sample, block_formats, chunk,
                                                             ops_cheap, monkeypatch):
    monkeypatch.setattr("lightning_precision.callbacks.amax.ops_are_cheap", lambda device: ops_cheap)
    if chunk is not None:
        monkeypatch.setattr("lightning_precision._amax_stats.CHUNK", chunk)
    model = Parallel()
    logger = AmaxHistoryLogger(history_len=history_len, amax_compute_algo=algo, margin=margin,
                               what_if_sample=sample, block_formats=block_formats)
    logger.attach(model)
    assert logger.layers == ["a", "b", "c", "idle", "never"]
    layers = logger.layers
    fp8_max = FP8_MAX
    steps = []  # per completed step: [layers, 3] amax
    last_nonzero = torch.zeros(len(layers), 3)
    n_logged = 0
    for step in range(11):
        log = step % 2 == 0 or step == 7
        # the scale in effect for this step, from the completed steps of the window
        window_steps = steps[-history_len:] if history_len > 0 else []
        window = torch.stack(window_steps).amax(dim=0) if window_steps else torch.zeros(len(layers), 3)
        previous = delayed_scale(last_nonzero, fp8_max, margin)
        chosen = window if algo == "max" else last_nonzero
        expected_scale = delayed_scale(chosen, fp8_max, margin, previous=previous)
        assert same(logger.scale, expected_scale), step
        rec = Recorder()
        metrics = run_step(model, logger, rec, step, log)
        amax = torch.stack([torch.stack([amax_of(rec.step.get(layer, {}).get(t, [])) for t in TENSORS])
                            for layer in layers])
        steps.append(amax)
        last_nonzero = torch.where(amax > 0, amax, last_nonzero)
        expected = {}
        if log:
            ran = [layer != "never" for layer in layers]
            for i, layer in enumerate(layers):
                if not ran[i]:
                    continue
                for k, t in enumerate(TENSORS):
                    expected[f"precision/amax/{t}/{layer}"] = amax[i, k]
                    expected[f"precision/fp8_scale/{t}/{layer}"] = expected_scale[i, k]
            expected.update(reference_what_if(rec.step, layers, amax, expected_scale, sample, block_formats))
            n_logged += 1
        assert sorted(metrics) == sorted(expected), step
        for key, value in expected.items():
            assert same(metrics[key], value), (step, key, metrics[key], value)
        # the history in TE's order: the completed steps of the window, oldest first
        chronological = logger.chronological_history()
        filled = min(len(steps), history_len - 1)
        want = torch.stack(steps[len(steps) - filled:]) if filled else torch.zeros(0, len(layers), 3)
        assert same(chronological, want), step
    assert n_logged == 7
    # the checkpoint carries the same numbers
    state = logger.state_dict()
    assert same(state["scale"], logger.scale) and same(state["last_nonzero"], last_nonzero)
    restored = AmaxHistoryLogger(history_len=history_len, amax_compute_algo=algo, margin=margin)
    restored.load_state_dict(state)
    restored.attach(model)
    assert same(restored.chronological_history(), logger.chronological_history())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float64])
def test_what_if_of_layers_larger_than_the_sample_equals_per_layer_measures_of_the_sample(dtype):
    """Above the sample size the pooled pass equals the per-layer measures of the same sample; float64 layers are
    measured per layer (the pooled pass is fp32)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 512), nn.Linear(512, 128)).to(dtype)
    logger = AmaxHistoryLogger(what_if_sample=4096)
    logger.attach(model)
    x = crafted((16, 256), 0, 1, dtype).requires_grad_()
    captured = {}
    hooks = [m.register_forward_hook(lambda mod, a, o, n=n: captured.__setitem__(n, (a[0].detach(), o)))
             for n, m in model.named_children()]
    logger.capturing(True)
    out = model(x)
    for h in hooks:
        h.remove()
    grads = {}
    for n, (_, o) in captured.items():
        o.register_hook(lambda g, n=n: grads.__setitem__(n, g.detach().clone()))
    out.backward(crafted(out.shape, 0, 2, dtype))
    metrics = logger.end_step(True)
    rec = {n: {"input": [captured[n][0]], "weight": [model.get_submodule(n).weight], "grad_output": [grads[n]]}
           for n in captured}
    amax = torch.stack([torch.stack([amax_of(rec[n][t]) for t in TENSORS]) for n in ("0", "1")])
    scale = torch.ones(2, 3)
    expected = reference_what_if(rec, ["0", "1"], amax, scale, 4096, ("mxfp8", "nvfp4"))
    for key, value in expected.items():
        assert same(metrics[key], value), key
    assert FORMATS["e4m3fn"].max == 448.0


def test_sampled_what_if_is_within_its_stated_bound_of_the_exact_figure():
    """Layers of different sizes and underflow rates (values scattered at random): the shared sample of n = 2**16
    estimates each fraction p of all layers together within 4 * sqrt(p * (1 - p) / n) for the per-tensor scales, and
    within 4 * sqrt(p * (1 - p) / (n / 32)) for the block formats, whose flushes depend on each block's max: a run of
    32 counts as one draw (four standard errors; the card states two as the typical error). Deterministic: the sample
    is evenly spaced runs, no random draw."""
    from lightning_precision._amax_stats import pooled_stats
    from lightning_precision.formats import get_format

    g = torch.Generator().manual_seed(0)
    tensors = []
    for n, p_tiny, p_huge in [(4096, 0.5, 0.0), (2**16, 0.2, 0.01), (2**18, 0.05, 0.001), (2**20, 0.01, 0.02)]:
        t = torch.randn(n, generator=g)
        u = torch.rand(n, generator=g)
        t[u < p_tiny] *= 1e-6  # flushes in e4m3 at scale 1
        t[u > 1 - p_huge] *= 1e4  # overflows e4m3
        tensors.append(t)
    numels = [t.numel() for t in tensors]
    amax = torch.stack([t.abs().amax() for t in tensors])
    ones = torch.ones(len(tensors))
    blocks = [get_format("mxfp8"), get_format("nvfp4")]
    exact = pooled_stats(shared_sample(tensors, numels, None), "e4m3fn", [ones, 448.0 / amax], blocks, amax)
    sampled_parts = shared_sample(tensors, numels, 2**16)
    assert abs(sum(p.numel() for p in sampled_parts) - 2**16) <= 32 * len(tensors)
    sampled = pooled_stats(sampled_parts, "e4m3fn", [ones, 448.0 / amax], blocks, amax)
    checked = 0
    for key, stats in exact.items():
        for name in ("underflow_fraction", "overflow_fraction"):
            p = float(getattr(stats, name))
            draws = 2**16 / 32 if key in ("mxfp8", "nvfp4") else 2**16
            bound = 4 * math.sqrt(p * (1 - p) / draws)
            assert abs(float(getattr(sampled[key], name)) - p) <= bound, (key, name)
            checked += p > 0
    assert checked >= 4  # not vacuous
