"""Llama (`llama`) with Meta's multi-token prediction heads (Gloeckle et al. 2024; the released 7B models, converted
by `mtp convert`: `model/meta.py`), under transformers' Llama names.

Backbone `model.embed_tokens`, `model.layers.{i}` (`self_attn` q/k/v/o without bias, rotate-half RoPE, GQA; SwiGLU
`mlp`; plain RMSNorms), `model.norm`, `lm_head` - a checkpoint transformers' `LlamaForCausalLM` reads as is. Meta's
model is a shared trunk (every layer but the last) with n independent heads on the trunk's output z_i: the next-token
head is the last backbone layer, the extra heads are held as `mtp.layers.{d-1}` (one Llama layer each, written under
the same names), and all heads share the final norm and the unembedding (docs/families.md, "Meta"):
    backbone   logits of t_{i+1}   = lm_head(norm(layers[L-1](z)_i)),    z = layers[0..L-2](embed(t))
    depth d    logits of t_{i+d+1} = lm_head(norm(mtp.layers[d-1](z)_i))        (parallel: no chain, no embedding)
So the MTP reads another state than the head: `hidden()` returns both, [norm(h_L) | z] ([B, T, 2H], `hidden_width`);
`head()` reads the first half, the heads the second. The last layer (`NextTokenHead`) passes its input z on beside
its output, and `final_hidden` normalises the output half only.
"""

from __future__ import annotations

import torch
from torch import nn

from ..config import LlamaConfig
from .base import CausalLM, MTPModule
from .cache import KVCache, Positions
from .gqa import GroupedQueryAttention
from .layer import MLP, DecoderLayer
from .nextn import Backbone, normal_init
from .norm import PlainRMSNorm
from .rope import RotaryTable, rotary_table


def llama_layer(config: LlamaConfig, cls: type[DecoderLayer] = DecoderLayer) -> DecoderLayer:
    c = config
    attention = GroupedQueryAttention(c.hidden_size, c.num_attention_heads, c.num_key_value_heads, c.head_dim, qkv_bias=False)
    return cls("self_attn", attention, MLP(c.hidden_size, c.intermediate_size),
               lambda: PlainRMSNorm(c.hidden_size, c.rms_norm_eps))


class NextTokenHead(DecoderLayer):
    """The last backbone layer, Meta's next-token head: x [B, T, H] (the trunk's output z) -> ([layer(x) | x]
    [B, T, 2H], the mixer's steps) - z goes on so that the extra heads can read it."""

    def forward(self, x: torch.Tensor, pos: Positions, cache=None):
        out, steps = super().forward(x, pos, cache)
        return torch.cat([out, x], dim=-1), steps


class MetaHeads(MTPModule):
    """Meta's extra heads `mtp.layers.{d-1}` (parallel style): depth d runs its own Llama layer on the trunk's output
    z (the second half of the backbone's hidden state) and the shared final norm, h^d = norm(layers[d-1](z))."""

    style = "parallel"

    def __init__(self, config: LlamaConfig, norm: nn.Module):
        super().__init__()
        self.layers = nn.ModuleList([llama_layer(config) for _ in range(config.mtp_num_hidden_layers)])
        self.hidden_size = config.hidden_size
        self.__dict__["shared_norm"] = norm  # the backbone's `model.norm`: used here, not a parameter of the module

    @property
    def max_depth(self) -> int:
        return self.num_layers

    def layer_for_depth(self, d: int) -> int:
        if not 1 <= d <= self.num_layers:
            raise ValueError(f"Meta's model has {self.num_layers} extra heads; depth {d} asked")
        return d - 1

    def step(self, d: int, hidden: torch.Tensor, emb: torch.Tensor | None, pos: Positions,
             cache: KVCache | None = None) -> torch.Tensor:
        """The backbone's hidden state [B, T, 2H] -> h^d [B, T, H] (after the shared final norm)."""
        x, _ = self.layers[self.layer_for_depth(d)](hidden[..., self.hidden_size:], pos, cache)
        return self.shared_norm(x)


class LlamaForCausalLM(CausalLM):
    """Llama backbone + head + Meta's extra heads (`mtp`, None for a plain Llama or a checkpoint without `mtp.*`)."""

    config_class = LlamaConfig
    mtp_input_projection = None  # (parallel heads: no input projection)

    @staticmethod
    def mtp_tensor_pattern(config: LlamaConfig) -> str:
        return "mtp.layers.* (Meta's extra heads)"

    def __init__(self, config: LlamaConfig, with_mtp: bool | None = None):
        super().__init__()
        self.config = c = config
        layers = [llama_layer(c) for _ in range(c.num_hidden_layers - 1)] + [llama_layer(c, NextTokenHead)]
        self.model = Backbone(nn.Embedding(c.vocab_size, c.hidden_size), layers, PlainRMSNorm(c.hidden_size, c.rms_norm_eps))
        self.lm_head = self.output_head(c.tie_word_embeddings)
        self.mtp = self.new_mtp_module() if with_mtp is not False and c.mtp_num_hidden_layers > 0 else None
        self.rotary: RotaryTable = rotary_table(c.rope(), c.head_dim, c.max_position_embeddings)

    @property
    def hidden_width(self) -> int:
        """[norm(h_L) | z]: the head's state and the trunk's output the extra heads read."""
        return 2 * self.config.hidden_size

    def new_mtp_module(self) -> MetaHeads:
        return MetaHeads(self.config, self.model.norm)

    def final_hidden(self, x: torch.Tensor) -> torch.Tensor:
        """[h_L | z] [B, T, 2H] -> [norm(h_L) | z]."""
        H = self.config.hidden_size
        return torch.cat([self.model.norm(x[..., :H]), x[..., H:]], dim=-1)

    def head(self, hidden: torch.Tensor) -> torch.Tensor:
        """[..., 2H] -> logits [..., V] of the next-token head."""
        return self.lm_head(hidden[..., : self.config.hidden_size])

    @torch.no_grad()
    def init_weights(self, std: float | None = None, modules: nn.Module | None = None) -> None:
        """As transformers initialises Llama: normal(0, std) weights, unit norms (`nextn.normal_init`)."""
        normal_init(modules or self, self.config.initializer_range if std is None else std)
