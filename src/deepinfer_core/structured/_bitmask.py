"""Checks shared by the matchers' ``fill_next_token_bitmask``."""

from __future__ import annotations

import torch


def check_bitmask(bitmask: torch.Tensor, row: int, words: int) -> None:
    """Raise a clear error unless ``bitmask[row]`` is a writable contiguous int32 CPU row of ``words``."""
    if not isinstance(bitmask, torch.Tensor):
        raise TypeError(f"bitmask: must be a torch.Tensor, got {type(bitmask).__name__}")
    if bitmask.dtype != torch.int32 or bitmask.device.type != "cpu" or bitmask.dim() != 2:
        raise ValueError(
            f"bitmask: must be a 2-D int32 CPU tensor, got {bitmask.dtype} {tuple(bitmask.shape)} on {bitmask.device}"
        )
    if bitmask.shape[1] != words:
        raise ValueError(
            f"bitmask: has {bitmask.shape[1]} words per row; this vocabulary needs {words} (ceil(vocab/32))"
        )
    if not 0 <= row < bitmask.shape[0]:
        raise IndexError(f"row={row}: must be in [0, {bitmask.shape[0]})")
    if not bitmask.is_contiguous():
        raise ValueError("bitmask: must be contiguous")


def allocate_bitmask(rows: int, vocab_size: int) -> torch.Tensor:
    """An int32 bitmask ``[rows, ceil(vocab_size / 32)]``, all tokens allowed."""
    return torch.full((rows, (vocab_size + 31) // 32), -1, dtype=torch.int32)
