from .generate import GenerationStream, generate, stream
from .prompt_cache import PromptCache
from .sampling import SamplingParams
from .session import GenerationResult, Session
from .stats import GenerationStats

__all__ = ["GenerationResult", "GenerationStats", "GenerationStream", "PromptCache", "SamplingParams", "Session", "generate", "stream"]
