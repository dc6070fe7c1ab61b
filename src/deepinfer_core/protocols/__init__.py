"""The small ``typing.Protocol`` interfaces the engine composes, one module per component.

A component depends on these protocols, never on another component's concrete class; the engine is the
only place that knows all concrete classes. Each protocol is ``runtime_checkable`` so tests can assert
that every concrete component satisfies its seam.
"""

from deepinfer_core.protocols.engine import Engine
from deepinfer_core.protocols.engram import EngramTable
from deepinfer_core.protocols.eplb import ExpertPlacementPolicy
from deepinfer_core.protocols.kv import KVBlockPool, PrefixIndex, StatePool
from deepinfer_core.protocols.kvstore import KVBlockStore
from deepinfer_core.protocols.model import Backend, InvariantRows, ModelExecutor, SpecControl
from deepinfer_core.protocols.scheduler import Scheduler, StepVote
from deepinfer_core.protocols.spec import VerifyScheduler
from deepinfer_core.protocols.structured import GrammarBackend, GrammarMatcher
from deepinfer_core.protocols.tokenizer import Tokenizer

__all__ = [
    "Backend",
    "Engine",
    "EngramTable",
    "ExpertPlacementPolicy",
    "GrammarBackend",
    "GrammarMatcher",
    "InvariantRows",
    "KVBlockPool",
    "KVBlockStore",
    "ModelExecutor",
    "PrefixIndex",
    "Scheduler",
    "SpecControl",
    "StatePool",
    "StepVote",
    "Tokenizer",
    "VerifyScheduler",
]
