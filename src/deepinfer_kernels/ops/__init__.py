"""Torch reference ops, one module per op; each registers itself with ``register(name, "reference")``."""
