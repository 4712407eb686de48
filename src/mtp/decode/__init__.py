from .generate import GenerationResult, GenerationStream, generate, stream
from .sampling import SamplingParams
from .stats import GenerationStats

__all__ = ["GenerationResult", "GenerationStats", "GenerationStream", "SamplingParams", "generate", "stream"]
