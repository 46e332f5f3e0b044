"""The process-wide effects of the plugins (``lightning_precision/_core/process_effects.py``): each is made while a
plugin needs it and undone after, in a fresh process (no plugin of another test alive). Lightning's ThroughputMonitor
is wrapped from a plugin's creation (an unpickled one's too, as ddp_spawn's process gets it) until it is collected;
torch's global optimizer-step pre-hook of true precision is held from ``convert_module`` until ``teardown`` (made again
by a plugin fitted again), or until a Fabric plugin, never torn down, is collected."""

import pickle
import subprocess
import sys
import textwrap
from pathlib import Path

import lightning_precision
from lightning_precision.fabric import FP16MixedPrecision
from tests.helpers import fabric_loop, make_data

ROOT = Path(__file__).resolve().parents[2]

SCRIPT = textwrap.dedent("""
    import gc
    import pickle
    import sys

    import lightning.fabric.utilities.throughput as fabric_throughput
    import lightning.pytorch.callbacks.throughput_monitor as trainer_throughput
    import torch
    from lightning.pytorch.callbacks import Callback
    from torch.optim.optimizer import _global_optimizer_pre_hooks as step_hooks  # torch's own table (test only)

    from lightning_precision import BF16MixedPrecision, BF16TruePrecision
    from lightning_precision import fabric as lp_fabric
    from lightning_precision._core.process_effects import FABRIC_THROUGHPUT, STATE_INIT_HOOK, TRAINER_THROUGHPUT
    from tests.helpers import LitNet, fabric_loop, loader, make_data, trainer

    lightnings = fabric_throughput._plugin_to_compute_dtype, trainer_throughput._plugin_to_compute_dtype
    hooks = len(step_hooks)

    def nothing_made():
        return not (FABRIC_THROUGHPUT.made or TRAINER_THROUGHPUT.made or STATE_INIT_HOOK.made)

    # What ddp_spawn's process gets: plugins pickled elsewhere (one between a step and its update), never built here.
    fabrics, trainers = pickle.loads(sys.stdin.buffer.read())
    print(fabrics.step_policy.kind, sorted(fabrics.state_dict().items()))
    assert FABRIC_THROUGHPUT.made and TRAINER_THROUGHPUT.made
    assert fabric_throughput._plugin_to_compute_dtype(fabrics) == torch.float16  # Lightning's alone says fp32
    assert trainer_throughput._plugin_to_compute_dtype(trainers) == torch.float16
    del fabrics, trainers
    gc.collect()
    assert nothing_made()

    plugin = BF16TruePrecision()
    assert FABRIC_THROUGHPUT.made and TRAINER_THROUGHPUT.made and not STATE_INIT_HOOK.made
    assert trainer_throughput._plugin_to_compute_dtype(plugin) == torch.bfloat16

    class Seen(Callback):
        def on_train_batch_start(self, *args):
            self.made = (STATE_INIT_HOOK.made, len(step_hooks))

    for fit in range(2):  # a plugin used again makes it again
        seen = Seen()
        trainer(plugin, max_steps=2, callbacks=[seen]).fit(LitNet(), loader(make_data(2)))
        assert seen.made == (True, hooks + 1), (fit, seen.made)
        assert not STATE_INIT_HOOK.made and len(step_hooks) == hooks, fit  # undone at teardown
        assert FABRIC_THROUGHPUT.made and TRAINER_THROUGHPUT.made  # the next stage's monitor reads it at its setup

    other = BF16MixedPrecision()
    del plugin, seen
    gc.collect()
    assert FABRIC_THROUGHPUT.made and TRAINER_THROUGHPUT.made  # another plugin still lives
    del other
    gc.collect()
    assert nothing_made()
    assert (fabric_throughput._plugin_to_compute_dtype, trainer_throughput._plugin_to_compute_dtype) == lightnings

    plugin = lp_fabric.BF16TruePrecision()
    _, net, fabric = fabric_loop(plugin, make_data(2), 2)  # Fabric never calls teardown
    assert STATE_INIT_HOOK.made and len(step_hooks) == hooks + 1
    del plugin, fabric
    gc.collect()
    assert nothing_made() and len(step_hooks) == hooks  # undone when the plugin is collected
    print("undone")
""")


def test_each_effect_is_made_while_needed_and_undone_after():
    plugin = FP16MixedPrecision()
    fabric_loop(plugin, make_data(2, overflow_batches=(1,)), 2)
    assert plugin.step_policy.update_pending  # pickled between a step and its update
    pickled = pickle.dumps((plugin, lightning_precision.FP16MixedPrecision()))
    done = subprocess.run([sys.executable, "-c", SCRIPT], cwd=ROOT, input=pickled, capture_output=True, timeout=300)
    out = done.stdout.decode()
    assert done.returncode == 0 and out.strip().endswith("undone"), done.stderr.decode()[-3000:]
    assert out.splitlines()[0] == f"loss-scaled {sorted(plugin.state_dict().items())}"  # its policy and state
    assert plugin.state_dict()["skipped_steps"] == 1
