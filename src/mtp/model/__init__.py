from .model import Qwen35ForCausalLM, Qwen35TextModel, init_weights_

__all__ = ["Qwen35ForCausalLM", "Qwen35TextModel", "init_weights_"]
