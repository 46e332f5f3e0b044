"""GradientUnderflowMonitor's parts, one concern a module (the callback itself: ``callbacks/underflow.py``)."""

__all__: list[str] = []
