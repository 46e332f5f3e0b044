"""Every private name of torch, Lightning and torchao this package uses: one module per upstream, each with a
behavioural canary test (tests/upstream/test_upstream_*.py)."""

__all__: list[str] = []
