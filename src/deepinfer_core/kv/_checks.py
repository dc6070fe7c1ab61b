"""Argument validation shared by the kv wrappers: clear errors that name the field and what is allowed."""

from __future__ import annotations

import numbers
from collections.abc import Sequence

import numpy as np


def check_int(name: str, value: object, *, min_value: int | None = None) -> int:
    """``value`` as a Python int, or ValueError/TypeError naming ``name``."""
    if type(value) is int:  # fast path: this runs on every pool call
        if min_value is not None and value < min_value:
            raise ValueError(f"{name} must be >= {min_value}, got {value}")
        return value
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    v = int(value)
    if min_value is not None and v < min_value:
        raise ValueError(f"{name} must be >= {min_value}, got {v}")
    return v


def as_i64(name: str, values: Sequence[int] | np.ndarray) -> np.ndarray:
    """C-contiguous int64 1-D array of ids (no copy when it already is one)."""
    a = np.asarray(values)
    if a.ndim != 1:
        raise ValueError(f"{name} must be 1-D, got shape {a.shape}")
    if a.size and not np.issubdtype(a.dtype, np.integer):
        raise TypeError(f"{name} must hold integers, got dtype {a.dtype}")
    return np.ascontiguousarray(a, dtype=np.int64)


def as_tokens(name: str, values: Sequence[int] | np.ndarray) -> np.ndarray:
    """C-contiguous int32 1-D token array; ids must fit int32."""
    a = np.asarray(values)
    if a.ndim != 1:
        raise ValueError(f"{name} must be 1-D, got shape {a.shape}")
    if a.size == 0:
        return np.zeros(0, dtype=np.int32)
    if not np.issubdtype(a.dtype, np.integer):
        raise TypeError(f"{name} must hold integer token ids, got dtype {a.dtype}")
    if a.dtype != np.int32 and (a.min() < np.iinfo(np.int32).min or a.max() > np.iinfo(np.int32).max):
        raise ValueError(f"{name} must fit int32")
    return np.ascontiguousarray(a, dtype=np.int32)


def as_key(extra_key: bytes | str | None) -> bytes:
    """Optional prefix-cache extra key (cache salt, adapter id) as bytes; None means no key."""
    if extra_key is None:
        return b""
    if isinstance(extra_key, str):
        return extra_key.encode()
    if isinstance(extra_key, bytes | bytearray):
        return bytes(extra_key)
    raise TypeError(f"extra_key must be bytes, str or None, got {type(extra_key).__name__}")
