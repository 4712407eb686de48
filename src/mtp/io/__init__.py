from .files import read_tensors
from .safetensors_mmap import CheckpointError
from .tokenizer import Tokenizer

__all__ = ["CheckpointError", "Tokenizer", "read_tensors"]
