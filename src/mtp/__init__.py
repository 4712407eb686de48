"""mtp: Multi-Token Prediction for PyTorch (Qwen3.5 layout) with lossless self-speculative decoding."""

from .config import ConfigError, Qwen35Config
from .io import CheckpointError, MissingMTPWarning, load_model, save_model
from .model import Qwen35ForCausalLM

__all__ = [
    "CheckpointError", "ConfigError", "MissingMTPWarning", "Qwen35Config", "Qwen35ForCausalLM",
    "load_model", "save_model",
]
__version__ = "0.1.0"
