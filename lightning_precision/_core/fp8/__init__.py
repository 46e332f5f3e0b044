"""``FP8Precision``'s engine: its arguments (``args``), the backend protocol (``backend``) and the two backends
(``backends``), the layer book (``layers``) and the ``layers="auto"`` calibration (``calibration``)."""

__all__: list[str] = []
