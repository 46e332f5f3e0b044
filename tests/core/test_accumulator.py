"""The accumulator behind GradientUnderflowMonitor, AmaxHistoryLogger and the sensitivity probe: declared reductions,
reset, a state_dict that resumes exactly, one collective per reduction on a sync across real gloo processes, and no
collective or device read on a step where nothing is logged."""

import io

import pytest
import torch

from lightning_precision._core.accumulator import Accumulator, all_reduce
from lightning_precision.callbacks import AmaxHistoryLogger, GradientUnderflowMonitor
from tests.distributed import start_ranks
from tests.helpers import QuietNet, count_host_reads, loader, make_data, trainer


def declared() -> Accumulator:
    acc = Accumulator()
    acc.add_state("count", torch.zeros(3, dtype=torch.int64), "sum")
    acc.add_state("peak", torch.zeros(2), "max")
    acc.add_state("floor", torch.full((2,), float("inf")), "min")
    acc.add_state("mine", torch.zeros(()), "last")
    return acc


def feed(acc: Accumulator, steps: range) -> None:
    for step in steps:
        acc.update("count", torch.tensor([1, step, step * step]))
        acc.update("peak", torch.tensor([float(step % 3), -1.0]))
        acc.update("floor", torch.tensor([float(10 - step), float(step)]))
        acc.update("mine", torch.tensor(float(step)))


def test_each_state_combines_by_its_reduction_and_reset_restores_the_defaults():
    acc = declared()
    default = acc["count"]
    feed(acc, range(4))
    assert acc["count"].tolist() == [4, 6, 14]
    assert acc["peak"].tolist() == [2.0, 0.0]  # max with the default 0
    assert acc["floor"].tolist() == [7.0, 0.0]
    assert acc["mine"].item() == 3.0  # "last": replaced
    assert default.tolist() == [0, 0, 0]  # never written in place (ddp_spawn shares a callback's tensors)
    acc.reset("count")
    assert acc["count"].tolist() == [0, 0, 0] and acc["mine"].item() == 3.0
    acc.reset()
    assert acc["peak"].tolist() == [0.0, 0.0] and acc["floor"].tolist() == [float("inf")] * 2
    with pytest.raises(ValueError, match=r"add_state\('x', reduction='mean'\).*'sum', 'max', 'min', 'last'"):
        acc.add_state("x", torch.zeros(()), "mean")


def test_a_state_dict_checkpoint_resumes_exactly():
    straight = declared()
    feed(straight, range(7))
    first = declared()
    feed(first, range(3))
    buffer = io.BytesIO()
    torch.save(first.state_dict(), buffer)
    buffer.seek(0)
    resumed = declared()
    resumed.load_state_dict(torch.load(buffer))
    feed(resumed, range(3, 7))
    for name in straight.names():
        assert torch.equal(resumed[name], straight[name]), name
    with pytest.raises(KeyError, match=r"undeclared state\(s\) \['other'\]"):
        resumed.load_state_dict({"other": torch.zeros(())})


def test_a_sync_reduces_each_reduction_and_dtype_in_one_call_and_leaves_the_states_alone():
    acc = declared()
    acc.add_state("hist", torch.zeros(2, 2, dtype=torch.int64), "sum")
    feed(acc, range(3))
    acc.update("hist", torch.ones(2, 2, dtype=torch.int64))
    seen = []

    def twice(t, op):  # two processes with the same values, as the reduction sees them
        seen.append((op, t.dtype, tuple(t.shape)))
        return t * 2 if op == "sum" else t

    before = {n: acc[n].clone() for n in acc.names()}
    synced = acc.sync(twice)
    # the two int64 sums travel flattened as one; a lone state keeps its shape; "last" is never reduced
    assert sorted(seen, key=str) == sorted([("sum", torch.int64, (7,)), ("max", torch.float32, (2,)),
                                            ("min", torch.float32, (2,))], key=str)
    assert synced["count"].tolist() == [6, 6, 10] and synced["hist"].tolist() == [[2, 2], [2, 2]]
    assert synced["mine"].item() == 2.0
    assert all(torch.equal(acc[n], before[n]) for n in acc.names())
    assert acc.sync(None)["count"].tolist() == [3, 3, 5]  # None: this process's values
    assert all_reduce(torch.ones(2)).tolist() == [1.0, 1.0]  # one process: nothing to reduce


def test_two_gloo_processes_sync_in_one_collective_per_reduction(tmp_path):
    import json

    failed = start_ranks(["-m", "tests.accumulator_worker", str(tmp_path), "sync"], tmp_path, timeout=120)
    assert failed is None, failed
    r0, r1 = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2))
    for r in (r0, r1):
        assert r["updates_calls"] == 0  # updates are local
        assert r["sync_calls"] == 4  # int64 sums (count + hist, flattened), the float64 sum, the max, the min
    mine = [r["synced"].pop("mine") for r in (r0, r1)]
    assert mine == [0.0, 1.0]  # "last" stays each rank's own
    assert r0["synced"] == r1["synced"]
    synced = r0["synced"]
    assert synced["count"] == [6, 3, 6]  # 3 steps (0, 1, 2) of [1, rank, step] on ranks 0 and 1
    assert synced["hist"] == [[9, 9], [9, 9]]  # 3 x (1 + 2)
    assert synced["power"] == pytest.approx(3 * (0.5 + 1.0))
    assert synced["peak"] == [1.0, 2.0] and synced["floor"] == [0.0, 8.0]
    assert r1["local"]["count"] == [3, 3, 3]  # the sync left the local states as they were


def test_under_ddp_the_callbacks_sync_only_on_logging_steps(tmp_path):
    """Two ranks, 6 steps logged every 3: the accumulator's collectives run at steps 2 and 5 (0-based), one for the
    monitor (its counts and histograms together) and one for the amax logger, plus the monitor's histogram at the end
    of fit; none on the other steps. Both ranks log the same fractions and amaxes."""
    import json

    failed = start_ranks(["-m", "tests.accumulator_worker", str(tmp_path), "fit"], tmp_path, timeout=200)
    assert failed is None, failed
    r0, r1 = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2))
    for r in (r0, r1):
        ours = [step for step, module in r["calls"] if module == "lightning_precision._core.accumulator"]
        assert ours == [2, 2, 5, 5, -1]
    assert r0["logged"] == r1["logged"] and r0["histogram"] == r1["histogram"]
    amax = [{k: v for k, v in r["amax"].items() if k.startswith("precision/amax/")} for r in (r0, r1)]
    assert amax[0] == amax[1]  # the max across ranks
    # The window keeps a logged step's global amax (steps 3, 4, 5 here: only step 5 logged), as TE's reduce_amax does;
    # the other steps hold each rank's own (its own half of the data).
    (h0, h1) = (r["amax_history"] for r in (r0, r1))
    assert len(h0) == 3 and h0[-1] == h1[-1] and h0[:-1] != h1[:-1]
    assert "precision/underflow/fp16" in r0["logged"] and "precision/amax/input/net.0" in r0["amax"]


def test_no_device_read_on_a_step_where_nothing_is_logged(monkeypatch):
    """Host reads (``item``, ``float``, ``int``, ``bool``) inside each callback's ``on_before_optimizer_step`` (and the
    monitor's ``on_train_batch_end``, where it logs once the step is done), over 6 steps logged every 3: none on the 4
    steps that log nothing."""
    reads = {}
    for cls in (GradientUnderflowMonitor, AmaxHistoryLogger):
        original = cls.on_before_optimizer_step

        def counting(self, *args, _original=original, _name=cls.__name__):
            current[0] = 0
            _original(self, *args)
            reads.setdefault(_name, []).append(current[0])

        monkeypatch.setattr(cls, "on_before_optimizer_step", counting)
    logging_hook = GradientUnderflowMonitor.on_train_batch_end

    def counting_end(self, *args):
        current[0] = 0
        logging_hook(self, *args)
        reads["GradientUnderflowMonitor"][-1] += current[0]

    monkeypatch.setattr(GradientUnderflowMonitor, "on_train_batch_end", counting_end)
    current = count_host_reads(monkeypatch)
    callbacks = [GradientUnderflowMonitor(formats="fp16", warn_threshold=1.0, activations=True), AmaxHistoryLogger()]
    trainer(None, max_steps=6, log_every_n_steps=3, callbacks=callbacks).fit(QuietNet(), loader(make_data(6)))
    monkeypatch.undo()
    for name, counts in reads.items():
        assert len(counts) == 6, name
        assert [counts[i] for i in (0, 1, 3, 4)] == [0, 0, 0, 0], (name, counts)
        assert counts[2] > 0 and counts[5] > 0, (name, counts)  # the logging steps do read: the test is not vacuous
