"""dayzero.serving: the engine (paged caches, continuous batching, prefix caching, jitted prefill/decode steps,
sampling), its tokenizer loading and the `dayzero-generate` command."""

from dayzero.model.errors import RequestError

from .engine import Engine, EngineConfig
from .request import RequestOutput
from .sampling import SamplingParams

__all__ = ["Engine", "EngineConfig", "RequestOutput", "SamplingParams", "RequestError"]
