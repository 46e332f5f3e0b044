"""``lightning-precision compare``: the arguments (``args``), the run of each precision in its own process
(``runner``, ``child``, ``preload``), the rows it measures (``rows``) and the report (``report``, ``plots``,
``outdir``). ``main`` is the command."""

__all__: list[str] = []
