"""Sharded training with FSDP2 (``fully_shard``) through Lightning's ``ModelParallelStrategy``, Trainer and Fabric.

Real processes (2 ranks, gloo, CPU, started by ``tests/distributed.py`` with a time bound and a free port), real FSDP2,
real torchao (``emulate=True``). Each rank trains on its half of every global batch, so together they must match one
process training on the whole batch with the same plugin (``fsdp_worker.reference``): the mean of the ranks' losses
and the full (all-gathered) parameters. Tolerances: the gradient of a half batch is rounded in the compute dtype
before FSDP2 averages it, so sharded and single-process runs differ by rounding (measured: losses within 4e-5 for
bf16/fp16 and 3e-3 for fp8, whose input scales are per rank; parameters within 2e-3 and 4e-3). A missing gradient
average or a rank training alone moves the parameters by more than 3e-2 after 4 steps.

The scenarios run in a few launches (``launches``), several one after the other in the same two processes: starting
two ranks (imports, process group) costs more than most scenarios. A launch runs when a test first asks for one of its
scenarios; a scenario that fails fails its own test with its traceback, and the ones after it in the launch say which
one stopped them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.distributed import run_ranks, run_scenarios
from tests.fsdp_worker import reference

STEPS = 4
LOSS_TOL = {"bf16": 1e-3, "fp16": 1e-3, "fp8": 5e-3}
PARAM_TOL = {"bf16": 5e-3, "fp16": 5e-3, "fp8": 1e-2}
MATCH_CASES = [(api, plugin) for plugin in ("bf16", "fp16", "fp8") for api in ("fabric", "trainer")]
INF_CASES = [("trainer", "fp16"), ("trainer", "bf16"), ("fabric", "bf16"), ("trainer", "fp8")]
CALLBACK_CASES = [("fp16", ["monitor"]), ("fp8", ["monitor", "amax"])]
RESUME_PLUGINS = ("fp16", "fp8")


@dataclass(frozen=True)
class Launch:
    scenarios: dict[str, dict[str, Any]]
    world_size: int = 2
    after: str | None = None  # the launch whose files this one reads (a checkpoint)


def _resume_base(plugin: str) -> dict[str, Any]:
    kwargs = {"growth_interval": 2} if plugin == "fp16" else {}
    # 4 batches an epoch: the checkpoint falls on an epoch boundary, where a resumed fit restarts the data exactly
    # (mid-epoch, Lightning restarts a plain DataLoader from its first batch).
    return {"api": "trainer", "plugin": plugin, "policy": True, "plugin_kwargs": kwargs, "data_steps": 4,
            "callbacks": ["monitor", "amax"]}


def _callbacks_cfg(plugin: str, callbacks: list[str]) -> dict[str, Any]:
    return {"api": "trainer", "plugin": plugin, "policy": True, "steps": 3, "callbacks": callbacks, "log_every": 2}


def launches(base: Path) -> dict[str, Launch]:
    """Every scenario of this file by launch. A scenario that ends in an error is last in its launch."""
    sharded: dict[str, dict[str, Any]] = {}
    for api, plugin in MATCH_CASES:
        kwargs = {"fsdp_float8_all_gather": True} if plugin == "fp8" and api == "fabric" else {}
        sharded[f"match-{api}-{plugin}"] = {"api": api, "plugin": plugin, "policy": True, "steps": STEPS,
                                            "plugin_kwargs": kwargs}
    sharded["no-policy"] = {"api": "trainer", "plugin": "bf16", "policy": False, "steps": 1}
    for api, plugin in INF_CASES:
        kwargs = {} if plugin == "fp16" else {"skip_nonfinite": True}
        sharded[f"inf-{api}-{plugin}"] = {"api": api, "plugin": plugin, "policy": True, "steps": STEPS, "inf_step": 2,
                                          "plugin_kwargs": kwargs}
    for plugin, callbacks in CALLBACK_CASES:
        sharded[f"callbacks-{plugin}"] = _callbacks_cfg(plugin, callbacks)
    sharded["channels-last"] = {"api": "trainer", "plugin": "bf16", "policy": True, "steps": STEPS, "model": "conv",
                                "callbacks": ["channels_last"]}
    sharded["sharded-before-conversion"] = {"api": "trainer", "plugin": "fp8", "policy": True, "steps": 1,
                                            "convert_first": False, "expect_error": True}
    fp8 = {"api": "fabric", "plugin": "fp8", "plugin_kwargs": {"fsdp_float8_all_gather": True}}
    rescaled = {"policy": False, "steps": STEPS, "rescale_at": 1}
    by_hand = {"plugin": {**fp8, "policy": False, "steps": STEPS},
               "torchao": {"api": "torchao", "policy": False, "steps": STEPS},
               "rescaled-plugin": {**rescaled, **fp8}, "rescaled-torchao": {**rescaled, "api": "torchao"}}
    save, load = {}, {}
    for plugin in RESUME_PLUGINS:
        save[f"straight-{plugin}"] = {**_resume_base(plugin), "steps": 8}
        save[f"first-{plugin}"] = {**_resume_base(plugin), "steps": 4, "save_every": 4,
                                   "save_to": str(base / f"ckpts-{plugin}")}
        load[f"resumed-{plugin}"] = {**_resume_base(plugin), "steps": 8,
                                     "resume": str(base / f"ckpts-{plugin}" / "ckpt.ckpt")}
    one_rank = {f"one-rank-callbacks-{plugin}": _callbacks_cfg(plugin, callbacks)
                for plugin, callbacks in CALLBACK_CASES}
    return {"sharded": Launch(sharded), "by-hand": Launch(by_hand), "resume-save": Launch(save),
            # in new processes: the resumed runs restore everything from the checkpoint
            "resume-load": Launch(load, after="resume-save"), "one-rank": Launch(one_rank, world_size=1)}


@dataclass
class Scenarios:
    """``ranks(name)``: each rank's results of one scenario of ``launches``, its launch run on first use."""

    base: Path
    launches: dict[str, Launch] = field(init=False, repr=False)
    results: dict[str, dict[str, list[dict] | str]] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        self.launches = launches(self.base)

    def _launch_of(self, name: str) -> str:
        return next(launch for launch, spec in self.launches.items() if name in spec.scenarios)

    def _run(self, launch: str) -> dict[str, list[dict] | str]:
        if launch not in self.results:
            spec = self.launches[launch]
            if spec.after is not None:
                self._run(spec.after)
            self.results[launch] = run_scenarios(spec.scenarios, self.base / launch, spec.world_size)
        return self.results[launch]

    def ranks(self, name: str) -> list[dict]:
        result = self._run(self._launch_of(name))[name]
        if isinstance(result, str):
            raise AssertionError(result)
        return result

    def params(self, name: str) -> dict[str, torch.Tensor]:
        self.ranks(name)
        return torch.load(self.base / self._launch_of(name) / name / "params.pt")


@pytest.fixture(scope="module")
def scenarios(tmp_path_factory) -> Scenarios:
    return Scenarios(tmp_path_factory.mktemp("fsdp"))


@pytest.fixture(scope="module")
def gloo_averages(tmp_path_factory):
    """Whether this torch's gloo averages in a reduce-scatter: torch 2.7's sums where FSDP2 asks it to average."""
    rank0, _ = run_ranks({"api": "gloo_average"}, tmp_path_factory.mktemp("gloo_average"))
    return rank0["averages"]


@pytest.fixture(autouse=True)
def _needs_a_gloo_that_averages(request, gloo_averages):
    if not gloo_averages and request.node.get_closest_marker("gloo_sums") is None:
        pytest.skip(f"gloo in torch {torch.__version__} sums where FSDP2 averages: the plugins refuse to train there"
                    " (test_a_gloo_that_sums_is_refused)")


@pytest.mark.gloo_sums
def test_a_gloo_that_sums_is_refused(tmp_path, gloo_averages):
    """On torch 2.7, gloo's reduce-scatter sums where FSDP2 asks for an average: gradients 2x on 2 ranks, silently.
    The plugins check once, before the first step, and stop with the reason."""
    if gloo_averages:
        pytest.skip(f"gloo in torch {torch.__version__} averages: nothing to refuse")
    ranks = run_ranks({"api": "fabric", "plugin": "bf16", "policy": True, "steps": 1, "expect_error": True}, tmp_path)
    for r in ranks:
        assert r["error"].startswith("RuntimeError: FSDP2 on gloo with torch")
        assert "2 times too large" in r["error"]


def _assert_matches_one_process(ranks: list[dict], params: dict, plugin: str) -> None:
    ref = reference(plugin, STEPS)
    mean = [sum(r["losses"][i] for r in ranks) / len(ranks) for i in range(STEPS)]
    assert mean == pytest.approx(ref["losses"], abs=LOSS_TOL[plugin])
    worst = max((params[k] - ref["params"][k]).abs().max().item() for k in params)
    assert worst < PARAM_TOL[plugin], f"full parameters differ from one process by {worst}"


@pytest.mark.parametrize(("api", "plugin"), MATCH_CASES)
def test_two_ranks_match_one_process_on_the_whole_batch(scenarios, api, plugin):
    name = f"match-{api}-{plugin}"
    ranks = scenarios.ranks(name)
    _assert_matches_one_process(ranks, scenarios.params(name), plugin)
    for r in ranks:
        assert r["warnings"] == []  # sharded with the plugin's policy: nothing to say
        assert set(r["layer_types"]) == {"FSDPFloat8Linear" if plugin == "fp8" else "FSDPLinear"}
        if plugin == "fp8":
            # Trainer: on by itself (ModelParallelStrategy seen at conversion); Fabric: asked for
            assert r["float8_all_gather"] is True


def test_fp8_plugin_equals_torchaos_fsdp2_recipe_written_by_hand(scenarios):
    """Convert, fully_shard, float8 all-gather, precompute the scales after each step: the plugin does what torchao's
    README does, to the bit (losses and full parameters)."""
    plugin, by_hand = scenarios.ranks("plugin"), scenarios.ranks("torchao")
    assert [r["losses"] for r in plugin] == [r["losses"] for r in by_hand]
    a, b = scenarios.params("plugin"), scenarios.params("torchao")
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_fp8_scales_precomputed_before_weights_changed_in_place_are_not_used(scenarios):
    """After step 1 every weight is made 4x larger in place (a checkpoint loaded into the live model would do the
    same). The scales the plugin precomputed after that step no longer fit: it must drop them, and then trains exactly
    as torchao's recipe by hand that precomputes again for the new weights. Stale scales would saturate the new weights
    at e4m3's max and change the losses."""
    plugin, by_hand = scenarios.ranks("rescaled-plugin"), scenarios.ranks("rescaled-torchao")
    assert [r["losses"] for r in plugin] == [r["losses"] for r in by_hand]


def test_a_model_sharded_without_the_policy_warns_and_says_what_to_pass(scenarios):
    ranks = scenarios.ranks("no-policy")
    (message,) = ranks[0]["warnings"]
    assert message.startswith("NoEffectWarning: BF16MixedPrecision computes in bfloat16")
    assert "model.0 (float32)" in message and "mp_policy=plugin.mp_policy" in message
    assert ranks[1]["warnings"] == []  # rank zero only


@pytest.mark.parametrize(("api", "plugin"), INF_CASES)
def test_an_inf_in_one_ranks_gradient_shard_skips_the_step_on_every_rank(scenarios, api, plugin):
    """Rank 1 alone writes an inf into its shard of the first layer's gradient at step 2. The scaler's inf check runs
    on DTensor gradients, which all-reduce it: both ranks skip that step (fp16 halves the scale), and their counters
    agree. bf16 and fp8 (bf16 compute) skip through the non-finite guard, the same check at a scale of 1
    (`skip_nonfinite=True`): no rank steps an inf into its shard while the other does not."""
    name = f"inf-{api}-{plugin}"
    for r in scenarios.ranks(name):
        assert r["skipped"] == [False, False, True, False]
        assert (r["skipped_steps"], r["loss_scale"]) == (1, 512.0 if plugin == "fp16" else None)
    params = scenarios.params(name)
    assert all(torch.isfinite(p).all() for p in params.values())


def test_trainer_fp8_on_a_model_sharded_before_conversion_fails_with_the_fix(scenarios):
    for r in scenarios.ranks("sharded-before-conversion"):
        assert r["error"].startswith("RuntimeError: FP8Precision: 3 layer(s) chosen for fp8 are already sharded")
        assert "self.trainer.precision_plugin.convert_module(self)" in r["error"]


@pytest.mark.parametrize("plugin", RESUME_PLUGINS)
def test_resume_from_a_distributed_checkpoint_equals_training_straight_through(scenarios, plugin):
    """8 steps in one go, against 4 steps, a distributed checkpoint (the strategy's own), and 4 more in new processes:
    the same parameters to the bit, for fp16 the same loss scale and growth (the scale grows every 2 steps), and the
    callbacks' state: GradientUnderflowMonitor's histogram and AmaxHistoryLogger's history window (16 steps, so the
    first 4 must come back from the checkpoint)."""
    straight = scenarios.ranks(f"straight-{plugin}")
    scenarios.ranks(f"first-{plugin}")
    resumed = scenarios.ranks(f"resumed-{plugin}")
    for s, r in zip(straight, resumed, strict=True):
        assert r["global_step"] == 8
        assert r["batches"] == s["batches"][4:] == [[1, 0], [1, 1], [1, 2], [1, 3]]
        assert r["losses"] == s["losses"][4:]
        assert (r["loss_scale"], r["skipped_steps"]) == (s["loss_scale"], s["skipped_steps"])
        for key in ("histogram", "amax_history", "amax_steps"):
            assert r["logged"][key] == s["logged"][key], key
        assert r["logged"]["amax_steps"] == 8 and len(r["logged"]["amax_history"]) == 8
    a, b = scenarios.params(f"straight-{plugin}"), scenarios.params(f"resumed-{plugin}")
    assert all(torch.equal(a[k], b[k]) for k in a)
    if plugin == "fp16":
        assert straight[0]["loss_scale"] == 1024.0 * 2**4  # it grew, so the restored growth tracker mattered


@pytest.mark.parametrize("plugin", [plugin for plugin, _ in CALLBACK_CASES])
def test_callbacks_report_the_global_truth_equal_on_every_rank(scenarios, plugin):
    """GradientUnderflowMonitor counts each element of the sharded gradients once across ranks (26896 parameters, as
    one process counts them), and its fractions match one process on the same global batch. AmaxHistoryLogger's weight
    amax is the whole weight's (also when it arrives all-gathered in fp8) and every amax is the same on every rank;
    a rank's grad_output amax is that of its own loss (a mean over its half batch: twice one process's)."""
    two, (one,) = scenarios.ranks(f"callbacks-{plugin}"), scenarios.ranks(f"one-rank-callbacks-{plugin}")
    n_params = 64 * 128 + 128 + 128 * 128 + 128 + 128 * 16 + 16
    # Measured every step, logged every 2: the logging step (step 2 of 3) sums two steps that counted every element once
    assert one["counted"] == [2 * n_params]
    assert [r["counted"] for r in two] == [[2 * n_params]] * 2
    # The exponent histogram is summed across ranks too, the part measured after the last logging step at the end of
    # fit: every rank holds one process's histogram (3 measured steps of 26896 gradients, less the exact zeros, which
    # it leaves out), up to the rounding that moves a value across a power of two or to zero. A rank's own shards would
    # hold about half.
    hists = [torch.tensor(r["logged"].pop("histogram")) for r in two]
    single = torch.tensor(one["logged"].pop("histogram"))
    assert torch.equal(hists[0], hists[1])
    assert 0.9 * 3 * n_params < int(single.sum()) <= 3 * n_params
    assert (hists[0] - single).abs().sum().item() < 0.01 * int(single.sum())
    if plugin == "fp16":  # no probe under FSDP2: the monitor says so rather than report no loss silently
        assert "the probe backward reached none of the model's parameters" in two[0]["warnings"][0]
    # Every metric one process logs, the ranks log too; only the top-k layers' names may differ (ties, all 0).
    top_k = "precision/underflow/fp16/model."
    assert ({k for k in one["logged"] if not k.startswith(top_k)}
            == {k for k in two[0]["logged"] if not k.startswith(top_k)})
    for key, value in one["logged"].items():
        if "fp8_whatif" in key or key.startswith(top_k):
            continue  # what-if: fractions of each rank's own sample of activations, not reduced
        got = [r["logged"][key] for r in two]
        assert got[0] == got[1], key
        if key.startswith(("precision/underflow", "precision/overflow", "precision/exact_zero")):
            assert got[0] == pytest.approx(value, abs=2e-3), key
        elif key.startswith("precision/amax/weight"):
            assert got[0] == pytest.approx(value, rel=1e-2), key
        elif key.startswith("precision/amax/grad_output"):
            assert got[0] == pytest.approx(2 * value, rel=0.2), key  # e5m2 backward: 2 mantissa bits




def test_channels_last_on_sharded_convolutions(scenarios):
    """FSDP2's ``fully_shard`` refuses channels-last (non-contiguous) parameters, and ``ChannelsLast`` converts in
    ``setup``, before ``configure_model`` shards: under ``ModelParallelStrategy`` it leaves the weights contiguous and
    converts the batches alone. Every convolution then computes and returns channels-last, and two ranks train as one
    process does on the whole batch (without channels-last: the layout does not change the numbers). A Fabric user who
    converts an already sharded model gets the same advice as an error, not a broken FSDP state."""
    ranks = scenarios.ranks("channels-last")
    for r in ranks:
        logged = r["logged"]
        assert (logged["weights_channels_last"], logged["converted"]) == (False, 2)
        assert logged["first_conv_input_channels_last"] is True
        assert logged["conv_outputs_channels_last"] == [True] * 2 * STEPS
        assert "sharded by FSDP2" in logged["apply_error"] and "to_channels_last(batch)" in logged["apply_error"]
        assert r["warnings"] == []
    ref = reference("bf16", STEPS, "conv")
    mean = [sum(r["losses"][i] for r in ranks) / len(ranks) for i in range(STEPS)]
    assert mean == pytest.approx(ref["losses"], abs=LOSS_TOL["bf16"])
    params = scenarios.params("channels-last")
    assert max((params[k] - ref["params"][k]).abs().max().item() for k in params) < PARAM_TOL["bf16"]
