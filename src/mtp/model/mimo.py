"""MiMo-7B (`mimo`, `MiMoForCausalLM`): a Qwen2 backbone and its MTP layers, under the checkpoint's names.

Backbone (Qwen2): `model.embed_tokens`, `model.layers.{i}` (`self_attn` with q/k/v bias and no o bias, full
rotate-half RoPE; SwiGLU `mlp`; plain RMSNorms), `model.norm`, `lm_head`. MTP layer i is stored as
`model.mtp_layers.{i}` and held as `mtp.layers.{i}`: `token_layernorm`, `hidden_layernorm`, `input_proj` [H, 2H],
a Qwen2 decoder layer's modules, `final_layernorm`. Depth d at position i (docs/families.md, "MiMo-7B"):
    x = input_proj(cat[hidden_layernorm(h^{d-1}_i), token_layernorm(embed(t_{i+d}))])      hidden FIRST
    h^d_i = final_layernorm(decoder_layer(x))       -> logits of t_{i+d+1} = lm_head(h^d_i), the shared head
h^0 is the backbone's hidden state BEFORE its final norm: for this family `hidden()` returns the last layer's output
and `head(h)` applies `model.norm` then `lm_head`.
"""

from __future__ import annotations

import re

import torch
from torch import nn

from ..config import MiMoConfig
from .base import MTP_LAYER, CausalLM
from .gqa import GroupedQueryAttention
from .layer import MLP, DecoderLayer
from .nextn import Backbone, NextNMTP, normal_init
from .norm import PlainRMSNorm
from .rope import RotaryTable, rotary_table

CKPT_MTP = re.compile(r"^model\.mtp_layers\.(\d+)\.(.+)$")


def qwen2_layer(config: MiMoConfig) -> tuple[nn.Module, nn.Module]:
    """A Qwen2 decoder layer's attention and MLP."""
    c = config
    return (GroupedQueryAttention(c.hidden_size, c.num_attention_heads, c.num_key_value_heads, c.head_dim, qkv_bias=True),
            MLP(c.hidden_size, c.intermediate_size))


class MiMoMTPLayer(DecoderLayer):
    """One MiMo MTP layer: a Qwen2 decoder layer plus `token_layernorm`, `hidden_layernorm`, `input_proj` and
    `final_layernorm` (see the module docstring for the equations)."""

    head = None  # the backbone's lm_head serves every depth

    def __init__(self, config: MiMoConfig):
        c = config
        norm = lambda: PlainRMSNorm(c.hidden_size, c.rms_norm_eps)  # noqa: E731
        super().__init__("self_attn", *qwen2_layer(c), norm)
        self.embed_tokens = None  # the backbone's embedding serves every depth
        self.token_layernorm = norm()
        self.hidden_layernorm = norm()
        self.input_proj = nn.Linear(2 * c.hidden_size, c.hidden_size, bias=False)
        self.final_layernorm = norm()

    def combine(self, emb: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        return self.input_proj(torch.cat([self.hidden_layernorm(hidden), self.token_layernorm(emb)], dim=-1))

    def finish(self, x: torch.Tensor) -> torch.Tensor:
        return self.final_layernorm(x)


class MiMoForCausalLM(CausalLM):
    """Qwen2 backbone + output head + MiMo's MTP layers (`mtp`, None when the checkpoint has no usable MTP)."""

    config_class = MiMoConfig
    mtp_input_projection = "input_proj"  # (stays unquantised: `CausalLM.precise_layers`)

    @staticmethod
    def internal_name(name: str, config: MiMoConfig | None = None) -> str | None:
        """Checkpoint tensor name -> our parameter name: `model.mtp_layers.{i}.*` -> `mtp.layers.{i}.*`."""
        m = CKPT_MTP.match(name)
        return name if m is None else f"mtp.layers.{m[1]}.{m[2]}"

    @staticmethod
    def checkpoint_name(name: str, config: MiMoConfig | None = None) -> str:
        """Our parameter name -> the checkpoint's."""
        m = MTP_LAYER.match(name)
        return name if m is None else f"model.mtp_layers.{m[1]}.{m[2]}"

    @staticmethod
    def mtp_tensor_pattern(config: MiMoConfig) -> str:
        """Where the checkpoint keeps its MTP tensors (for messages)."""
        return "model.mtp_layers.*"

    def __init__(self, config: MiMoConfig, with_mtp: bool | None = None):
        super().__init__()
        self.config = c = config
        norm = lambda: PlainRMSNorm(c.hidden_size, c.rms_norm_eps)  # noqa: E731
        layers = [DecoderLayer("self_attn", *qwen2_layer(c), norm) for _ in range(c.num_hidden_layers)]
        self.model = Backbone(nn.Embedding(c.vocab_size, c.hidden_size), layers, norm())
        self.lm_head = self.output_head(c.tie_word_embeddings)
        self.mtp = self.new_mtp_module() if with_mtp is not False and c.num_nextn_predict_layers > 0 else None
        self.rotary: RotaryTable = rotary_table(c.rope(), c.head_dim, c.max_position_embeddings)

    def new_mtp_module(self) -> NextNMTP:
        """A fresh MTP module for this config (training heads onto a checkpoint that has none)."""
        return NextNMTP([MiMoMTPLayer(self.config) for _ in range(self.config.num_nextn_predict_layers)])

    def final_hidden(self, x: torch.Tensor) -> torch.Tensor:
        """MiMo's MTP reads the last layer's output before the final norm: `hidden()` returns it as is."""
        return x

    def head(self, hidden: torch.Tensor) -> torch.Tensor:
        """Pre-norm backbone hidden [..., H] -> logits [..., V]: the final norm, then lm_head."""
        return self.lm_head(self.model.norm(hidden))

    @torch.no_grad()
    def init_weights(self, std: float | None = None, modules: nn.Module | None = None) -> None:
        """Initialise for training from scratch (all of the model, or only `modules`) as transformers does
        (`nextn.normal_init`)."""
        normal_init(modules or self, self.config.initializer_range if std is None else std)
