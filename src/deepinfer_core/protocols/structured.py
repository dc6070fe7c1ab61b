"""Seams of structured outputs (``deepinfer_core.structured``)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

if TYPE_CHECKING:  # annotations only: the protocols stay importable without torch
    import torch


@runtime_checkable
class GrammarMatcher(Protocol):
    """Per-request grammar state over token ids."""

    def accept_token(self, token_id: int) -> bool:
        """Advance by one token. False (state unchanged) if the grammar does not allow it."""
        ...

    def fill_next_token_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the allowed next tokens into int32 ``bitmask[row]`` (bit set = allowed).

        Bit ``t % 32`` of word ``t // 32`` is token ``t``. Control tokens other than EOS are never
        allowed; EOS is allowed exactly where the grammar may end; after EOS nothing is allowed.
        """
        ...

    def rollback(self, num_tokens: int) -> None:
        """Undo the last ``num_tokens`` accepted tokens."""
        ...

    def is_terminated(self) -> bool:
        """True once the grammar has accepted the end-of-sequence token."""
        ...

    def reset(self) -> None:
        """Back to the initial state."""
        ...


@runtime_checkable
class GrammarBackend(Protocol):
    """A grammar engine (xgrammar, llguidance) bound to one tokenizer."""

    @property
    def vocab_size(self) -> int:
        """Mask width in tokens (the logits width); bitmask rows have ``ceil(vocab_size / 32)`` words."""
        ...

    def compile(self, spec: Any) -> Any:
        """Compile a GrammarSpec; raises ``ValueError`` with the backend's message if the spec is invalid."""
        ...

    def matcher(self, compiled: Any) -> GrammarMatcher:
        """A fresh matcher (initial state) for a compiled grammar; many may share one compiled grammar."""
        ...
