"""How a step is scaled and checked: the step policy (plain, guarded, loss-scaled), the loss scaler and its saved
state, the loss-scale range."""

__all__: list[str] = []
