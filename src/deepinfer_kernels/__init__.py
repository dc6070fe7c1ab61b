"""Device ops for deepinfer-components.

Every op has a torch reference (any device, the ground truth) registered under backend ``"reference"``;
where it pays, a TileLang kernel or an adapter to a DeepSeek library is registered under ``"cuda"``.
``get_op(name, backend)`` is the one dispatch point: a backend without a specialised kernel falls back to
the reference. TileLang and DeepSeek's libraries are imported lazily, only when a cuda op is asked for.
"""

from deepinfer_kernels.registry import (
    CudaBackend,
    ReferenceBackend,
    available_libraries,
    get_backend,
    get_op,
    list_ops,
    register,
)

__all__ = [
    "CudaBackend",
    "ReferenceBackend",
    "available_libraries",
    "get_backend",
    "get_op",
    "list_ops",
    "register",
]
