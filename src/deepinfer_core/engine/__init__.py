"""The thin reference engine: ``LLM(...).generate(prompts, SamplingParams)`` on the built-in tiny model.

``LLMEngine`` is the step loop (schedule -> batch -> execute -> mask + sample -> update) over the
library's components; ``LLM`` is the offline API on top; ``RequestOutput`` is what comes back.
"""

from deepinfer_core.engine.config import EngineConfig
from deepinfer_core.engine.engine import LLMEngine
from deepinfer_core.engine.llm import LLM
from deepinfer_core.engine.outputs import RequestOutput
from deepinfer_core.engine.requests import RequestError
from deepinfer_core.engine.stats import StepStats

__all__ = ["LLM", "EngineConfig", "LLMEngine", "RequestError", "RequestOutput", "StepStats"]
