"""The thin reference engine: ``LLM(...).generate(prompts, SamplingParams)`` on the built-in tiny model.

``LLMEngine`` is the step loop (schedule -> batch -> execute -> mask + sample -> update) over the
library's components; ``LLM`` is the offline API on top, ``AsyncLLM`` the asyncio one (a server's); ``RequestOutput``
is what comes back (streamed, per step).
"""

from deepinfer_core.engine.async_llm import AsyncLLM, EngineDeadError
from deepinfer_core.engine.config import EngineConfig
from deepinfer_core.engine.engine import LLMEngine
from deepinfer_core.engine.llm import LLM
from deepinfer_core.engine.outputs import CompletionOutput, RequestOutput
from deepinfer_core.engine.requests import RequestError
from deepinfer_core.engine.stats import StepStats
from deepinfer_core.sampling_params import RequestOutputKind

__all__ = [
    "LLM",
    "AsyncLLM",
    "CompletionOutput",
    "EngineConfig",
    "EngineDeadError",
    "LLMEngine",
    "RequestError",
    "RequestOutput",
    "RequestOutputKind",
    "StepStats",
]
