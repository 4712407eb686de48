from .checkpoint import MissingMTPWarning, load_model, save_model
from .safetensors_mmap import CheckpointError

__all__ = ["CheckpointError", "MissingMTPWarning", "load_model", "save_model"]
from .tokenizer import Tokenizer  # noqa: E402

__all__ += ["Tokenizer"]
