"""The engine the Fabric and the Trainer plugins share: autocast, loss scaling, the true-precision step, the
step policy, sharding checks. Private: import the public classes from ``lightning_precision`` or
``lightning_precision.fabric``."""

__all__: list[str] = []
