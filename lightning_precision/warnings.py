"""Warnings of the package."""


class NoEffectWarning(UserWarning):
    """A transform or plugin found nothing to change (no convolution to make channels-last, no layer to run in fp8)."""
