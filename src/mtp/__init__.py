"""mtp: Multi-Token Prediction for PyTorch - MTP models (Qwen3.5 layout) with lossless self-speculative decoding."""

from .config import ConfigError, Qwen35Config
from .decode import GenerationResult, PromptCache, generate, stream
from .io import CheckpointError, Tokenizer
from .model import CausalLM, MissingMTPWarning, Qwen35ForCausalLM, load_model, save_model

__all__ = [
    "CausalLM", "CheckpointError", "ConfigError", "GenerationResult", "MissingMTPWarning", "PromptCache", "Qwen35Config",
    "Qwen35ForCausalLM", "Tokenizer", "generate", "load_model", "save_model", "stream",
]
__version__ = "0.2.0"
