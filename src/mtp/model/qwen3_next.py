"""Qwen3-Next (`qwen3_next`, Qwen3-Next-80B-A3B): Qwen3.5's blocks with three differences, under the checkpoint's names
(docs/families.md, "Qwen3-Next"):

- Gated DeltaNet's input projections are two fused matrices grouped by key head: `in_proj_qkvz` holds, for each
  of the Hk key heads, [q (Kd) | k (Kd) | v (r Vd) | z (r Vd)] with r = Hv / Hk, and `in_proj_ba` [b (r) | a (r)];
  they are split here into the conv input [all q | all k | all v] and z, b, a exactly as Qwen3.5's separate
  projections give them (the rest of the mixer is Qwen3.5's);
- the MLP is the sparse MoE block (softmax top-k, renormalised when `norm_topk_prob`, + the gated shared expert) or
  a dense SwiGLU, per layer (`decoder_sparse_step`, `mlp_only_layers`); the MTP layer's by the same rule on its
  index among the MTP layers (vLLM's numbering);
- the MTP count is `num_nextn_predict_layers` (absent in the released config: 1). The MTP module itself is Qwen3.5's
  `mtp.*` (fc over [pre_fc_norm_embedding(embed); pre_fc_norm_hidden(h)], a full-attention layer, norm), which
  transformers drops and vLLM's `qwen3_next_mtp.py` reads.
"""

from __future__ import annotations

import torch
from torch import nn

from ..config import Qwen3NextConfig
from .attention import GatedAttention
from .base import CausalLM
from .deltanet import GatedDeltaNet
from .layer import MLP, DecoderLayer
from .linear import project
from .moe import SparseMoE
from .norm import RMSNorm
from .qwen3_5 import Qwen35MoeForCausalLM, Qwen35MTP
from .rope import rotary_table


class Qwen3NextGatedDeltaNet(GatedDeltaNet):
    """Qwen3.5's Gated DeltaNet reading Qwen3-Next's grouped `in_proj_qkvz` [2 Hk Kd + 2 Hv Vd, H] and `in_proj_ba`
    [2 Hv, H] (see the module docstring)."""

    fused_projections = ("in_proj_qkvz", "in_proj_ba")  # one matmul at inference (`linear.project`)

    def input_projections(self, hidden: int) -> None:
        self.in_proj_qkvz = nn.Linear(hidden, 2 * self.key_dim + 2 * self.value_dim, bias=False)
        self.in_proj_ba = nn.Linear(hidden, 2 * self.num_v_heads, bias=False)

    def projections(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """x [B, T, H] -> qkv [B, T, C], z [B, T, Hv Vd], b, a [B, T, Hv] in Qwen3.5's order (a reordering only)."""
        B, T, _ = x.shape
        qkvz, ba = project(self, x, "in_proj_qkvz", "in_proj_ba")
        Hk, Kd = self.num_k_heads, self.head_k_dim
        rv = self.num_v_heads // Hk * self.head_v_dim  # the value width of one key head's group
        q, k, v, z = qkvz.reshape(B, T, Hk, 2 * Kd + 2 * rv).split([Kd, Kd, rv, rv], dim=-1)
        b, a = ba.reshape(B, T, Hk, -1).chunk(2, dim=-1)
        flat = lambda t: t.reshape(B, T, -1)  # noqa: E731  (group-major: value head g*r + j, as Qwen3.5 numbers them)
        return torch.cat([flat(q), flat(k), flat(v)], dim=-1), flat(z), flat(b), flat(a)


def feed_forward(config: Qwen3NextConfig, i: int) -> nn.Module:
    """Layer i's MLP: the sparse MoE block, or SwiGLU (`Qwen3NextConfig.is_moe_layer`)."""
    c = config
    if c.is_moe_layer(i):
        return SparseMoE(c.hidden_size, c.num_experts, c.num_experts_per_tok, c.moe_intermediate_size,
                         c.shared_expert_intermediate_size, c.norm_topk_prob)
    return MLP(c.hidden_size, c.intermediate_size)


def decoder_layer(config: Qwen3NextConfig, kind: str, i: int) -> DecoderLayer:
    """Layer i of `kind` 'full_attention' (`self_attn`: Qwen3.5's gated attention) or 'linear_attention'."""
    c = config
    mixer = ("self_attn", GatedAttention(c)) if kind == "full_attention" else ("linear_attn", Qwen3NextGatedDeltaNet(c))
    return DecoderLayer(*mixer, feed_forward(c, i), lambda: RMSNorm(c.hidden_size, c.rms_norm_eps))


class Qwen3NextModel(nn.Module):
    """The backbone: `model.embed_tokens`, `model.layers.{i}`, `model.norm`."""

    def __init__(self, config: Qwen3NextConfig):
        super().__init__()
        c = config
        self.embed_tokens = nn.Embedding(c.vocab_size, c.hidden_size)
        self.layers = nn.ModuleList([decoder_layer(c, c.layer_type(i), i) for i in range(c.num_hidden_layers)])
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)


class Qwen3NextForCausalLM(Qwen35MoeForCausalLM):
    """Backbone + output head + the `mtp.*` module (None when the checkpoint holds none). Init, the load-balancing
    loss, the expert layouts (per expert or fused, written back as read) and what stays unquantised are
    Qwen3.5-MoE's."""

    config_class = Qwen3NextConfig

    @staticmethod
    def internal_name(name: str, config: Qwen3NextConfig | None = None) -> str | None:
        return name

    def __init__(self, config: Qwen3NextConfig, with_mtp: bool | None = None):
        CausalLM.__init__(self)  # not Qwen3.5's __init__: it would build Qwen3.5's layers
        self.config = config
        self.model = Qwen3NextModel(config)
        self.lm_head = self.output_head(config.tie_word_embeddings)
        self.mtp = self.new_mtp_module() if with_mtp is not False and config.num_nextn_predict_layers > 0 else None
        self.rotary = rotary_table(config.rope(), config.head_dim, config.max_position_embeddings)

    def new_mtp_module(self) -> Qwen35MTP:
        c = self.config
        return Qwen35MTP(c, lambda i: decoder_layer(c, "full_attention", i))
