from .base import CausalLM, init_weights_
from .cache import Cache
from .checkpoint import MissingMTPWarning, NonFiniteWeightsWarning, load_model, save_model
from .deepseek_v3 import DeepseekV3ForCausalLM
from .families import FAMILIES, config_from_dict, config_from_json
from .glm4_moe import Glm4MoeForCausalLM
from .mimo import MiMoForCausalLM
from .qwen3_5 import Qwen35ForCausalLM

__all__ = ["FAMILIES", "Cache", "CausalLM", "DeepseekV3ForCausalLM", "Glm4MoeForCausalLM", "MiMoForCausalLM",
           "MissingMTPWarning", "NonFiniteWeightsWarning", "Qwen35ForCausalLM", "config_from_dict",
           "config_from_json", "init_weights_", "load_model", "save_model"]
