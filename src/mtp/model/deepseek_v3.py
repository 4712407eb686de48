"""DeepSeek-V3/R1: MLA + DeepSeekMoE backbone and its MTP layers, under the checkpoint's names; the base class it
shares with GLM-4.5/4.6/4.7 (`glm4_moe.py`), which differs only in its attention.

Backbone `model.embed_tokens`, `model.layers.{i}` (`self_attn`, `mlp`: SwiGLU before layer `first_k_dense_replace`,
DeepSeekMoE from it on, two plain RMSNorms), `model.norm`, `lm_head`. MTP layer i is stored as
`model.layers.{num_hidden_layers + i}` and held as `mtp.layers.{i}` (so `mtp.*` is the MTP module, as in every
family). Depth d at position i (docs/families.md, "DeepSeek-V3/R1 and GLM-4.5/4.6/4.7"):
    x = eh_proj(cat[enorm(embed(t_{i+d})), hnorm(h^{d-1}_i)])        embedding first
    h^d_i = shared_head.norm(decoder_layer(x))                        -> logits of t_{i+d+1} = shared_head.head(h^d_i)
h^0 is the backbone's hidden state after its final norm; the MTP layer's own `embed_tokens` / `shared_head.head`
are used when the checkpoint holds them, the backbone's otherwise (GLM-4.6). The embedding at position 0 is not
zeroed (docs/families.md). The MTP layer's MLP is DeepSeekMoE (its index is past `first_k_dense_replace`).
"""

from __future__ import annotations

import copy
import re

import torch
from torch import nn

from ..config import DeepseekV3Config, NextNMoeConfig
from .base import MTP_LAYER, CausalLM
from .layer import MLP, DecoderLayer
from .mla import MLAttention
from .moe import DeepseekMoE
from .nextn import Backbone, NextNLayer, NextNMTP, normal_init
from .norm import PlainRMSNorm
from .rope import RotaryTable, rotary_table

LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")


class NextNMoeForCausalLM(CausalLM):
    """What DeepSeek-V3 and GLM-4.5 share: the backbone but its attention, the MoE, the MTP layers stored after the
    backbone's, names, init. A subclass supplies `attention(config, layer)` and `rotary_head_dim(config)`.

    Checkpoints hold the routed experts per expert (as transformers writes them) or fused, per layer; they are read
    into the fused form and written back as read (`experts_key`, see `base.CausalLM.checkpoint_sources`). The
    router's `weight` and `e_score_correction_bias` stay fp32 (as transformers keeps them)."""

    config_class = NextNMoeConfig
    fp32_parameters = ("mlp.gate.weight", "mlp.gate.e_score_correction_bias")
    experts_key = "n_routed_experts"
    mtp_input_projection = "eh_proj"  # (stays unquantised: `CausalLM.precise_layers`)

    @staticmethod
    def attention(config: NextNMoeConfig, layer: int) -> nn.Module:
        """Layer `layer`'s attention (MTP layers continue the numbering)."""
        raise NotImplementedError

    @staticmethod
    def rotary_head_dim(config: NextNMoeConfig) -> int:
        raise NotImplementedError

    # ------------------------------------------------------------------ checkpoint names
    @staticmethod
    def internal_name(name: str, config: NextNMoeConfig) -> str | None:
        """Checkpoint tensor name -> our parameter name: MTP layer `model.layers.{L + i}.*` -> `mtp.layers.{i}.*`."""
        m = LAYER.match(name)
        if m is not None and int(m[1]) >= config.num_hidden_layers:
            return f"mtp.layers.{int(m[1]) - config.num_hidden_layers}.{m[2]}"
        return name

    @staticmethod
    def checkpoint_name(name: str, config: NextNMoeConfig) -> str:
        """Our parameter name -> the checkpoint's."""
        m = MTP_LAYER.match(name)
        return name if m is None else f"model.layers.{config.num_hidden_layers + int(m[1])}.{m[2]}"

    @staticmethod
    def mtp_tensor_pattern(config: NextNMoeConfig) -> str:
        """Where the checkpoint keeps its MTP tensors (for messages)."""
        return f"model.layers.{config.num_hidden_layers}.* (one per num_nextn_predict_layers)"

    @classmethod
    def checkpoint_config(cls, config: NextNMoeConfig, names: list[str]) -> NextNMoeConfig:
        """The config with what only the tensor names say: whether the MTP layers hold their own `embed_tokens` and
        `shared_head.head` (GLM-4.6 has neither). Unchanged when the checkpoint holds no MTP layer."""
        layers: dict[int, set[str]] = {}  # MTP layer i -> the names of its tensors inside the layer
        for name in names:
            if (m := MTP_LAYER.match(cls.internal_name(name, config))) is not None:
                layers.setdefault(int(m[1]), set()).add(m[2])
        if not layers:
            return config
        c = copy.deepcopy(config)
        c.mtp_embed_tokens = any("embed_tokens.weight" in inner for inner in layers.values())
        c.mtp_shared_head = any("shared_head.head.weight" in inner for inner in layers.values())
        return c

    # ------------------------------------------------------------------ modules
    def __init__(self, config: NextNMoeConfig, with_mtp: bool | None = None):
        super().__init__()
        self.config = c = config
        layers = [DecoderLayer("self_attn", self.attention(c, i), self.feed_forward(i), self.norm_factory())
                  for i in range(c.num_hidden_layers)]
        self.model = Backbone(nn.Embedding(c.vocab_size, c.hidden_size), layers, PlainRMSNorm(c.hidden_size, c.rms_norm_eps))
        self.lm_head = self.output_head(c.tie_word_embeddings)
        self.mtp = self.new_mtp_module() if with_mtp is not False and c.num_nextn_predict_layers > 0 else None
        self.rotary: RotaryTable = rotary_table(c.rope(), self.rotary_head_dim(c), c.max_position_embeddings)

    def norm_factory(self):
        c = self.config
        return lambda: PlainRMSNorm(c.hidden_size, c.rms_norm_eps)

    def feed_forward(self, i: int) -> nn.Module:
        """Layer i's MLP (MTP layers continue the numbering): SwiGLU, or DeepSeekMoE from `first_k_dense_replace` on."""
        c = self.config
        if not c.is_moe_layer(i):
            return MLP(c.hidden_size, c.intermediate_size)
        return DeepseekMoE(c.hidden_size, c.n_routed_experts, c.num_experts_per_tok, c.moe_intermediate_size,
                           c.n_shared_experts, c.n_group, c.topk_group, c.norm_topk_prob, c.routed_scaling_factor)

    def new_mtp_module(self) -> NextNMTP:
        """A fresh MTP module for this config (training heads onto a checkpoint that has none)."""
        c = self.config
        L = c.num_hidden_layers
        return NextNMTP([NextNLayer(self.attention(c, L + i), self.feed_forward(L + i), self.norm_factory(),
                                    c.hidden_size, c.vocab_size, c.mtp_embed_tokens, c.mtp_shared_head)
                         for i in range(c.num_nextn_predict_layers)])

    @torch.no_grad()
    def init_weights(self, std: float | None = None, modules: nn.Module | None = None) -> None:
        """Initialise for training from scratch (all of the model, or only `modules`) as transformers does
        (`nextn.normal_init`). MTP layers with their own embedding / head start as copies of the backbone's
        (DeepSeek-V3 trains them shared)."""
        scope = modules or self
        normal_init(scope, self.config.initializer_range if std is None else std)
        inside = set(scope.modules())
        for layer in self.mtp.layers if self.mtp is not None else []:
            if layer.embed_tokens is not None and layer.embed_tokens in inside:
                layer.embed_tokens.weight.copy_(self.model.embed_tokens.weight)
            if layer.head is not None and layer.head in inside:
                layer.head.weight.copy_(self.lm_head.weight)


class DeepseekV3ForCausalLM(NextNMoeForCausalLM):
    """DeepSeek-V3/R1 (`deepseek_v3`): multi-head latent attention (`mla.py`) with YaRN RoPE on its rope part."""

    config_class = DeepseekV3Config

    @staticmethod
    def attention(config: DeepseekV3Config, layer: int) -> nn.Module:
        return MLAttention(config)

    @staticmethod
    def rotary_head_dim(config: DeepseekV3Config) -> int:
        return config.qk_rope_head_dim
