"""The engine's grammar manager, built on the first constrained request (the structured extra is optional)."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from deepinfer_core.protocols import Tokenizer

if TYPE_CHECKING:
    from deepinfer_core.structured import StructuredOutputManager

log = logging.getLogger(__name__)


class Grammars:
    """Holds the one ``StructuredOutputManager`` of an engine (it outlives ``LLMEngine.reset``)."""

    def __init__(self, backend: str, tokenizer: Tokenizer, vocab_size: int) -> None:
        self.backend = backend
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.manager: StructuredOutputManager | None = None  # None until a request asks for a grammar

    def get(self) -> StructuredOutputManager:
        """The manager, built now if no request needed one before (ImportError without the extra)."""
        if self.manager is None:
            from deepinfer_core.structured import StructuredOutputManager, make_backend

            self.manager = StructuredOutputManager(
                make_backend(self.backend, self.tokenizer, vocab_size=self.vocab_size)
            )
            log.debug("engine: grammar manager built (%s backend)", self.backend)
        return self.manager
