"""Training state beyond model and optimizer: resumable data loading and RNG streams."""

__all__: list[str] = []
