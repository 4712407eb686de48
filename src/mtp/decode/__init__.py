from .generate import GenerationStream, generate, stream
from .sampling import SamplingParams
from .session import GenerationResult, Session
from .stats import GenerationStats

__all__ = ["GenerationResult", "GenerationStats", "GenerationStream", "SamplingParams", "Session", "generate", "stream"]
