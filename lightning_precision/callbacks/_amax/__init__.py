"""AmaxHistoryLogger's parts, one concern a module (the callback itself: ``callbacks/amax.py``)."""

__all__: list[str] = []
