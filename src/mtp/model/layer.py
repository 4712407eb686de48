"""Decoder layer (pre-norm mixer + SwiGLU MLP), shared by the backbone and the MTP module."""

import torch
import torch.nn.functional as F
from torch import nn

from ..config import Qwen35Config
from .attention import GatedAttention
from .cache import AttnCache, DeltaCache
from .deltanet import GatedDeltaNet
from .norm import RMSNorm


class MLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    """`kind` is 'full_attention' (module `self_attn`) or 'linear_attention' (module `linear_attn`)."""

    def __init__(self, config: Qwen35Config, kind: str):
        super().__init__()
        self.kind = kind
        if kind == "full_attention":
            self.self_attn = GatedAttention(config)
        else:
            self.linear_attn = GatedDeltaNet(config)
        self.mlp = MLP(config.hidden_size, config.intermediate_size)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
        cache: AttnCache | DeltaCache | None = None, pos: int = 0, record: bool = False,
    ) -> torch.Tensor:
        """x [B, T, H] at positions pos.. -> [B, T, H]."""
        h = self.input_layernorm(x)
        if self.kind == "full_attention":
            h = self.self_attn(h, cos, sin, cache, pos)
        else:
            h = self.linear_attn(h, cache, record)
        x = x + h
        return x + self.mlp(self.post_attention_layernorm(x))
