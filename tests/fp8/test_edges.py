"""The model's edges seen in a forward (``EdgeRecorder``, ``edges_of``) and the layer rules that keep them in high
precision (``select_fp8_layers(edges=...)``, ``FP8LayerPolicy(first_last_blocks=...)``)."""

import doctest
import importlib.util
import warnings

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from lightning_precision import FP8LayerPolicy
from lightning_precision._warnings import NoEffectWarning
from lightning_precision.fp8 import _edges, select_fp8_layers
from lightning_precision.fp8._edges import FIRST_REASON, LAST_REASON, EdgeRecorder, edges_of
from lightning_precision.fp8._selection import block_stack

# Hugging Face's DistilBERT when transformers is installed (built from a small config: nothing is downloaded); else
# the stand-in below, with its layer names and data flow.
HAVE_TRANSFORMERS = importlib.util.find_spec("transformers") is not None


def linears(model):
    return {fqn: m for fqn, m in model.named_modules() if isinstance(m, nn.Linear)}


class _Attention(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.q_lin, self.k_lin, self.v_lin, self.out_lin = (nn.Linear(dim, dim) for _ in range(4))

    def forward(self, x):
        q, k, v = self.q_lin(x), self.k_lin(x), self.v_lin(x)
        return self.out_lin(torch.softmax(q @ k.transpose(-1, -2), -1) @ v)


class _Block(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.attention = _Attention(dim)
        self.ffn = nn.Sequential(nn.Linear(dim, 2 * dim), nn.GELU(), nn.Linear(2 * dim, dim))
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)

    def forward(self, x):
        x = self.norm1(x + self.attention(x))
        return self.norm2(x + self.ffn(x))


class _Transformer(nn.Module):
    def __init__(self, dim, layers):
        super().__init__()
        self.layer = nn.ModuleList(_Block(dim) for _ in range(layers))


class _Body(nn.Module):
    def __init__(self, dim, layers):
        super().__init__()
        self.embeddings = nn.Embedding(64, dim)
        self.transformer = _Transformer(dim, layers)

    def forward(self, input_ids):
        x = self.embeddings(input_ids)
        for block in self.transformer.layer:
            x = block(x)
        return x


class StandInDistilBert(nn.Module):
    """DistilBERT's names and data flow: embeddings, ``transformer.layer`` blocks with q/k/v/out_lin, then
    ``pre_classifier`` on the first token and ``classifier``."""

    def __init__(self, dim=32, layers=3, labels=16):
        super().__init__()
        self.distilbert = _Body(dim, layers)
        self.pre_classifier, self.classifier = nn.Linear(dim, dim), nn.Linear(dim, labels)

    def forward(self, input_ids):
        return self.classifier(torch.relu(self.pre_classifier(self.distilbert(input_ids)[:, 0])))


def distilbert(layers=3):
    torch.manual_seed(0)
    if not HAVE_TRANSFORMERS:
        return StandInDistilBert(layers=layers).eval()
    from transformers import DistilBertConfig, DistilBertForSequenceClassification

    config = DistilBertConfig(vocab_size=64, dim=32, n_layers=layers, n_heads=2, hidden_dim=64,
                              max_position_embeddings=16, num_labels=16)  # type: ignore[call-arg]
    return DistilBertForSequenceClassification(config).eval()  # eval: no dropout between the embedding and q/k/v


def ids(batch=2):
    return torch.randint(0, 64, (batch, 8), generator=torch.Generator().manual_seed(batch))


def logits(model, x):
    out = model(x)
    return out if isinstance(out, torch.Tensor) else out.logits


DISTILBERT_EDGES = {"distilbert.transformer.layer.0.attention.q_lin": FIRST_REASON,
                    "distilbert.transformer.layer.0.attention.k_lin": FIRST_REASON,
                    "distilbert.transformer.layer.0.attention.v_lin": FIRST_REASON,
                    "classifier": LAST_REASON}


@pytest.mark.parametrize("grad", [True, False], ids=["training", "no_grad"])
def test_distilbert_edges_are_qkv_of_layer_0_and_the_classifier(grad):
    model = distilbert()
    recorder = EdgeRecorder(linears(model), model=model)
    with torch.set_grad_enabled(grad):
        out = logits(model, ids())
    if grad:
        out.sum().backward()
    assert recorder.edges() == DISTILBERT_EDGES  # out_lin and pre_classifier are not edges
    recorder.close()


def test_selection_keeps_every_reader_of_the_embedding_in_high_precision():
    model = distilbert()
    qkv = [f"distilbert.transformer.layer.0.attention.{n}" for n in ("q_lin", "k_lin", "v_lin")]
    by_order = {d.fqn: d for d in select_fp8_layers(model, skip_small_layers=False)}
    # The registration-order rule alone: only q_lin stays high, k_lin and v_lin go to fp8.
    assert [by_order[fqn].fp8 for fqn in qkv] == [False, True, True]
    with torch.no_grad():
        edges = edges_of(model, lambda: model(ids()))
    decided = {d.fqn: d for d in select_fp8_layers(model, skip_small_layers=False, edges=edges)}
    for fqn in [*qkv, "classifier"]:
        assert not decided[fqn].fp8
        assert decided[fqn].reason == f"{edges[fqn]} (kept in high precision for accuracy)"
    assert decided["distilbert.transformer.layer.0.attention.out_lin"].fp8
    assert decided["pre_classifier"].fp8  # the registration-order rule is replaced, not added to
    assert sum(not d.fp8 for d in decided.values()) == 4
    # skip_first_last=False: no edge is kept; module_filter decides alone.
    assert all(d.fp8 for d in select_fp8_layers(model, skip_small_layers=False, skip_first_last=False, edges=edges))
    only = select_fp8_layers(model, module_filter=lambda m, fqn: True, edges=edges)
    assert all(d.fp8 for d in only)


def test_an_mlp_reads_its_input_with_its_first_layer():
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4))
    x = torch.randn(3, 8, requires_grad=True)
    recorder = EdgeRecorder(linears(model))  # no model: the backward ends the first forward
    model(x).sum().backward()
    assert recorder.edges() == {"0": FIRST_REASON, "4": LAST_REASON}
    assert recorder.done and not recorder._handles


class Branches(nn.Module):
    """Parallel layers on the input and parallel heads, a layer called twice, a layer that never runs, and a second
    path taken from the second forward on."""

    def __init__(self):
        super().__init__()
        self.gate, self.up = nn.Linear(8, 16), nn.Linear(8, 16)
        self.shared = nn.Linear(16, 16)
        self.head_a, self.head_b, self.other_head = nn.Linear(16, 4), nn.Linear(16, 4), nn.Linear(16, 4)
        self.unused = nn.Linear(16, 16)
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        h = self.gate(x) * self.up(x.view(x.shape))  # a view of the input is the same tensor
        h = self.shared(torch.relu(self.shared(h)))
        if self.calls > 1:
            return self.other_head(h)
        return self.head_a(h) + self.head_b(h[:, :])


def test_parallel_readers_repeated_calls_and_layers_that_never_run():
    model = Branches()
    recorder = EdgeRecorder(linears(model), model=model)
    with torch.no_grad():
        model(torch.randn(2, 8))
        model(torch.randn(5, 8))  # ignored: it ends at other_head
    assert recorder.edges() == {"gate": FIRST_REASON, "up": FIRST_REASON, "head_a": LAST_REASON,
                                "head_b": LAST_REASON}
    assert recorder.done


def test_a_second_forward_changes_nothing_and_close_removes_every_hook():
    model = distilbert()
    layers = linears(model)
    recorder = EdgeRecorder(layers, model=model)
    with torch.no_grad():
        logits(model, ids(2))
        first = recorder.edges()
        logits(model, ids(3))  # another batch size
    assert recorder.edges() == first == DISTILBERT_EDGES
    closed = EdgeRecorder(layers, model=model)
    closed.close()
    closed.close()  # idempotent
    assert all(not m._forward_pre_hooks and not m._forward_hooks for m in [model, *layers.values()])
    with torch.no_grad():
        logits(model, ids())
    assert closed.calls == [] and closed.edges() == {}


def test_the_edges_are_what_the_model_gave_not_what_another_pre_hook_made():
    model = distilbert()
    for layer in linears(model).values():  # a cast or a probe that hands each layer a new tensor
        layer.register_forward_pre_hook(lambda m, args: (args[0].clone(),))
    with torch.no_grad():
        assert edges_of(model, lambda: model(ids())) == DISTILBERT_EDGES


class Checkpointed(nn.Module):
    def __init__(self, reentrant):
        super().__init__()
        self.inp = nn.Linear(8, 16)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 16)) for _ in range(2))
        self.head = nn.Linear(16, 4)
        self.reentrant = reentrant

    def forward(self, x):
        h = self.inp(x)
        for block in self.blocks:
            h = checkpoint(block, h, use_reentrant=self.reentrant)
        return self.head(h)


@pytest.mark.parametrize("reentrant", [False, True], ids=["non_reentrant", "reentrant"])
@pytest.mark.parametrize("bracket", [True, False], ids=["model", "backward"])
def test_gradient_checkpointing_recomputation_is_not_a_forward(reentrant, bracket):
    model = Checkpointed(reentrant)
    recorder = EdgeRecorder(linears(model), model=model if bracket else None)
    for _ in range(2):
        model(torch.randn(2, 8, requires_grad=True)).sum().backward()
    assert recorder.edges() == {"inp": FIRST_REASON, "head": LAST_REASON}
    assert len(recorder.calls) == 6  # the first forward only: its recomputations in the backward came after it


def test_a_freed_input_whose_memory_is_reused_is_another_tensor():
    """Without a bracket (no model, no backward) every call counts: a tensor freed after the first layer read it and
    a new one at the same address must not be taken for it (an address-keyed identity would)."""
    first, other, head = nn.Linear(1024, 16), nn.Linear(1024, 16), nn.Linear(16, 4)
    with torch.no_grad():
        for _ in range(200):
            recorder = EdgeRecorder({"first": first, "other": other, "head": head})
            x = torch.randn(4, 1024)
            address = x.data_ptr()
            first(x)
            del x
            y = torch.randn(4, 1024)
            if y.data_ptr() == address:
                break
            recorder.stop()
        else:
            pytest.skip("the allocator never reused the freed input's memory in 200 tries")
        other(y)
        head(torch.randn(2, 16))
    assert recorder.edges() == {"first": FIRST_REASON, "head": LAST_REASON}
    recorder.stop()


def test_a_layer_at_both_ends():
    tied = nn.Linear(8, 8)
    model = nn.Sequential(tied, nn.ReLU(), nn.Linear(8, 8), tied)  # the same layer first and last
    with torch.no_grad():
        assert edges_of(model, lambda: model(torch.randn(2, 8))) == {"0": f"{FIRST_REASON}; {LAST_REASON}"}


def test_edges_given_under_an_alias_or_unknown():
    shared = nn.Linear(16, 16)
    model = nn.Sequential(nn.Linear(16, 16), shared, nn.Linear(16, 16))
    model.alias = shared
    decided = {d.fqn: d for d in select_fp8_layers(model, skip_small_layers=False, edges={"alias": "named"})}
    assert not decided["1"].fp8 and decided["1"].reason == "named (kept in high precision for accuracy)"
    assert decided["0"].fp8 and decided["2"].fp8
    with pytest.raises(ValueError, match=r"model\.1 is no nn\.Linear of this model"):
        select_fp8_layers(model, edges={"model.1": "first"})
    with pytest.raises(TypeError, match=r"select_fp8_layers\(edges=\['0'\]\)`: pass a mapping"):
        select_fp8_layers(model, edges=["0"])  # type: ignore[arg-type]
    # An empty mapping (no forward seen) falls back on the registration order.
    assert [d.fp8 for d in select_fp8_layers(model, skip_small_layers=False, edges={})] == [False, True, False]


def test_bad_recorder_arguments():
    with pytest.raises(TypeError, match=r"EdgeRecorder\(layers="):
        EdgeRecorder([nn.Linear(2, 2)])  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"EdgeRecorder\(model="):
        EdgeRecorder({}, model="model")  # type: ignore[arg-type]


class Encoder(nn.Module):
    """An nn.TransformerEncoder between an input projection and a head."""

    def __init__(self, blocks=4):
        super().__init__()
        self.inp = nn.Linear(16, 32)
        layer = nn.TransformerEncoderLayer(32, 2, dim_feedforward=64, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, blocks, enable_nested_tensor=False)
        self.head = nn.Linear(32, 16)

    def forward(self, x):
        return self.head(self.encoder(self.inp(x)))


def test_first_last_blocks_on_a_transformer_encoder():
    model = Encoder(blocks=4)
    assert block_stack(model) == ("encoder.layers", list(model.encoder.layers))
    policy = FP8LayerPolicy(skip_small_layers=False, skip_first_last=False, first_last_blocks=1)
    decided = {d.fqn: d for d in select_fp8_layers(model, layer_policy=policy)}
    for i in range(4):
        for name in ("linear1", "linear2"):
            d = decided[f"encoder.layers.{i}.{name}"]
            assert d.fp8 == (i in (1, 2)), d
        assert "functionally" in decided[f"encoder.layers.{i}.self_attn.out_proj"].reason  # rule 2 first
    assert decided["encoder.layers.0.linear1"].reason == (
        "in block 0 of 4 of `encoder.layers`, among the first 1 (first_last_blocks=1: kept in high precision for"
        " accuracy)")
    assert "among the last 1" in decided["encoder.layers.3.linear2"].reason
    assert decided["inp"].fp8 and decided["head"].fp8  # outside the stack: skip_first_last's (here off)
    # Beside the edges rule, not instead of it.
    both = {d.fqn: d.fp8 for d in select_fp8_layers(model, layer_policy=FP8LayerPolicy(skip_small_layers=False,
                                                                                       first_last_blocks=1))}
    assert not both["inp"] and not both["head"] and both["encoder.layers.1.linear1"]


def test_first_last_blocks_on_distilbert():
    model = distilbert(layers=4)
    stack = block_stack(model)
    assert stack is not None and stack[0] == "distilbert.transformer.layer"
    policy = FP8LayerPolicy(skip_small_layers=False, first_last_blocks=1)
    with torch.no_grad():
        edges = edges_of(model, lambda: model(ids()))
    high = {d.fqn for d in select_fp8_layers(model, layer_policy=policy, edges=edges) if not d.fp8}
    blocks = {fqn for fqn in linears(model) if fqn.startswith(("distilbert.transformer.layer.0.",
                                                               "distilbert.transformer.layer.3."))}
    assert high == blocks | {"classifier"}
    assert len(blocks) == 12  # q, k, v, out_lin and the two feed-forward layers, in two blocks


def test_first_last_blocks_that_cover_every_block_or_find_none_say_so():
    model = Encoder(blocks=3)
    with pytest.warns(UserWarning, match=r"has 3 blocks, so the first and last 2 are all of them.*at most 1"):
        decided = select_fp8_layers(model, layer_policy=FP8LayerPolicy(skip_small_layers=False, first_last_blocks=2))
    assert not any(d.fp8 for d in decided if d.fqn.startswith("encoder."))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        select_fp8_layers(Encoder(blocks=3), layer_policy=FP8LayerPolicy(first_last_blocks=1))  # 1 of 3: no warning
    lone = nn.Sequential(nn.Linear(16, 16), nn.ReLU())
    with pytest.warns(NoEffectWarning, match="no stack of repeated blocks"):
        select_fp8_layers(lone, layer_policy=FP8LayerPolicy(first_last_blocks=1))


@pytest.mark.parametrize("value", [-1, 1.5, True, "2", None])
def test_first_last_blocks_must_be_a_whole_number(value):
    with pytest.raises(ValueError, match=rf"select_fp8_layers\(first_last_blocks={value!r}\)"):
        select_fp8_layers(Encoder(), layer_policy=FP8LayerPolicy(first_last_blocks=value))


def test_first_last_blocks_with_a_module_filter_is_an_error():
    policy = FP8LayerPolicy(module_filter=lambda m, fqn: True, first_last_blocks=1)
    with pytest.raises(ValueError, match="the module_filter decides alone"):
        select_fp8_layers(Encoder(), layer_policy=policy)


def test_the_plugin_takes_first_last_blocks():
    from lightning_precision.fabric import FP8Precision

    with pytest.raises(ValueError, match=r"FP8Precision\(first_last_blocks=-2\)"):
        FP8Precision(emulate=True, layer_policy=FP8LayerPolicy(first_last_blocks=-2))
    plugin = FP8Precision(emulate=True, layer_policy=FP8LayerPolicy(skip_small_layers=False, first_last_blocks=1))
    plugin.convert_module(Encoder(blocks=4))
    fp8 = {d.fqn for d in plugin.layer_decisions if d.fp8}
    assert fp8 == {f"encoder.layers.{i}.{n}" for i in (1, 2) for n in ("linear1", "linear2")}


def test_docstring_examples_run():
    result = doctest.testmod(_edges, optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE, report=True)
    assert result.failed == 0 and result.attempted >= 4


@pytest.mark.parametrize("bracket", [True, False], ids=["model", "backward"])
def test_recorded_during_the_measurement_pass(bracket):
    """How a plan records the edges: one recorder on every linear layer during fp8_sensitivity's pass over the
    batches (autocast, the probe's own hooks, a gradient-only backward), the first batch's forward counting."""
    from lightning_precision.fp8 import fp8_sensitivity

    model = distilbert()
    recorder = EdgeRecorder(linears(model), model=model if bracket else None)
    try:
        measured = fp8_sensitivity(model, [ids(2), ids(3), ids(4)], "tensorwise",
                                   loss_fn=lambda m, batch: logits(m, batch).float().pow(2).mean())
    finally:
        recorder.close()
    assert set(measured) == set(linears(model))
    assert recorder.edges() == DISTILBERT_EDGES
    assert len(recorder.calls) == len(linears(model))  # one forward's calls


class FailsOnce(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b, self.head = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 4)
        self.failed = False

    def forward(self, x):
        h = self.b(self.a(x))
        if not self.failed:
            self.failed = True
            raise RuntimeError("a batch the loop skips")
        return self.head(h)


def test_a_forward_that_raises_is_not_the_first_forward():
    model = FailsOnce()
    recorder = EdgeRecorder(dict(model.named_children()), model=model)
    with torch.no_grad():
        with pytest.raises(RuntimeError, match="skips"):
            model(torch.randn(2, 8))
        assert not recorder.done
        model(torch.randn(2, 8))
        assert recorder.done  # the next forward that ends closes the record
        model(torch.randn(2, 8))
    assert recorder.edges() == {"a": FIRST_REASON, "head": LAST_REASON}
    assert len(recorder.calls) == 5
