"""deepinfer-components: DeepInfer's engine components, each importable on its own.

Subpackages (``kv``, ``scheduler``, ``eplb``, ``spec``, ``structured``, ``engram``, ``model``, ...) are
imported lazily by the caller; importing ``deepinfer_core`` itself loads nothing heavy.
"""

from __future__ import annotations

import logging

__version__ = "0.1.0"

logging.getLogger(__name__).addHandler(logging.NullHandler())
