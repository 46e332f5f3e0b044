"""The process-wide effects of the plugins (``lightning_precision/_core/process_effects.py``): each is made while a
plugin needs it and undone after, in a fresh process (no plugin of another test alive): Lightning's ThroughputMonitor
wrapped from a plugin's construction until it is collected, torch's global optimizer-step pre-hook of true precision
from ``convert_module`` until ``teardown``, made again by a plugin fitted again."""

import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

SCRIPT = textwrap.dedent("""
    import gc

    import lightning.fabric.utilities.throughput as fabric_throughput
    import lightning.pytorch.callbacks.throughput_monitor as trainer_throughput
    import torch
    from lightning.pytorch.callbacks import Callback
    from torch.optim.optimizer import _global_optimizer_pre_hooks as step_hooks  # torch's own table (test only)

    from lightning_precision import BF16MixedPrecision, BF16TruePrecision
    from lightning_precision._core.process_effects import FABRIC_THROUGHPUT, STATE_INIT_HOOK, TRAINER_THROUGHPUT
    from tests.helpers import LitNet, loader, make_data, trainer

    lightnings = fabric_throughput._plugin_to_compute_dtype, trainer_throughput._plugin_to_compute_dtype
    hooks = len(step_hooks)
    assert not (FABRIC_THROUGHPUT.made or TRAINER_THROUGHPUT.made or STATE_INIT_HOOK.made)

    plugin = BF16TruePrecision()
    assert FABRIC_THROUGHPUT.made and TRAINER_THROUGHPUT.made and not STATE_INIT_HOOK.made
    assert trainer_throughput._plugin_to_compute_dtype(plugin) == torch.bfloat16  # Lightning's alone says fp32
    assert fabric_throughput._plugin_to_compute_dtype(plugin) == torch.bfloat16

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
    assert not (FABRIC_THROUGHPUT.made or TRAINER_THROUGHPUT.made)
    assert (fabric_throughput._plugin_to_compute_dtype, trainer_throughput._plugin_to_compute_dtype) == lightnings
    print("undone")
""")


def test_each_effect_is_made_while_needed_and_undone_after():
    done = subprocess.run([sys.executable, "-c", SCRIPT], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.strip().endswith("undone"), done.stderr[-3000:]
