"""The true-precision plugins' engine: the plugin core (``precision``), its fp32 optimizer step (``step``) and
the step's parts (rounding, states, chunks on flat buffers, shards, hooks)."""

__all__: list[str] = []
