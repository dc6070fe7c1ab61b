"""The executor seam's plain data, re-exported where the model's users have always imported it from
(``deepinfer_core.model.ForwardBatch``); it lives in the neutral :mod:`deepinfer_core.batch`, so other
components (``swa``) build batches without importing the model component."""

from deepinfer_core.batch import BatchError, ForwardBatch, ForwardOutput

__all__ = ["BatchError", "ForwardBatch", "ForwardOutput"]
