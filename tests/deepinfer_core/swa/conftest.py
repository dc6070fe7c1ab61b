"""The swa tests use the model tests' fixtures (one torch thread, a seeded float64 tiny model)."""

from tests.deepinfer_core.model.conftest import _one_thread, model64  # noqa: F401
