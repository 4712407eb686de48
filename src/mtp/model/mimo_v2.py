"""MiMo-V2-Flash (`mimo_v2_flash`): hybrid global / sliding-window attention, sigmoid-routed MoE and three MTP layers,
under the checkpoint's names (docs/families.md, "MiMo-V2-Flash").

Backbone `model.embed_tokens`, `model.layers.{i}`, `model.norm`, `lm_head`. Layer i's `self_attn` is global or
sliding-window attention (`MiMoV2FlashConfig.layer_type`): q_proj [A*D, H], k_proj [K*D, H], v_proj [K*Dv, H] (the
values scaled by `attention_value_scale`), o_proj [H, A*Dv], partial rotate-half RoPE with the kind's own theta;
sliding layers have twice the key/value heads, a window and `attention_sink_bias` [A] (`sliding.py`). Its `mlp` is
SwiGLU or DeepSeek's routed MoE without shared experts (`mlp.gate`, `mlp.experts.*`). Plain RMSNorms.

MTP layer i is stored as `model.mtp.layers.{i}` and held as `mtp.layers.{i}` (its `pre_mlp_layernorm` as our
`post_attention_layernorm`): `enorm`, `hnorm`, `eh_proj` [H, 2H], a sliding-window attention layer with sinks, a
dense SwiGLU `mlp`, `final_layernorm`; the backbone's embedding and lm_head. Depth d at position i:
    x = eh_proj(cat[enorm(embed(t_{i+d})), hnorm(h^{d-1}_i)])        embedding first
    h^d_i = final_layernorm(decoder_layer(x))       -> logits of t_{i+d+1} = lm_head(h^d_i)
h^0 is the backbone's hidden state after its final norm. Depth d <= 3 runs MTP layer d (its own layer, as the model
was trained; engines that load only layer 0 reuse it for every depth); deeper drafts reuse the layers cyclically
(`base.MTPModule.layer_for_depth`), as every family's MTP does past its layer count.
"""

from __future__ import annotations

import copy
import re

import torch
from torch import nn

from ..config.mimo_v2 import KINDS, MiMoV2FlashConfig
from .attention import attend
from .base import MTP_LAYER, CausalLM
from .cache import KVCache, Positions
from .layer import MLP, DecoderLayer
from .linear import project
from .moe import DeepseekMoE
from .nextn import Backbone, NextNMTP, normal_init
from .norm import PlainRMSNorm
from .rope import RotaryTable, apply_rope, rotary_table
from .sliding import attend_window

CKPT_MTP = re.compile(r"^model\.mtp\.layers\.(\d+)\.(.+)$")
# The checkpoint's name of an MTP layer's second norm, and ours (every other decoder layer's).
CKPT_MLP_NORM, MLP_NORM = "pre_mlp_layernorm.", "post_attention_layernorm."


class MiMoV2Attention(nn.Module):
    """`self_attn` of one layer kind ('full_attention' or 'sliding_attention'; see the module docstring). Scale
    D^-1/2; RoPE on the first R dims of each head with the kind's tables (`Positions.rotary_by_kind`)."""

    fused_projections = ("q_proj", "k_proj", "v_proj")  # one matmul at inference (`linear.project`)

    def __init__(self, config: MiMoV2FlashConfig, kind: str):
        super().__init__()
        c = config
        self.kind = kind
        self.num_heads, self.num_kv_heads = c.attention_shape(kind)
        self.head_dim, self.v_head_dim = c.head_dim, c.v_head_dim
        self.value_scale = c.value_scale
        self.window = c.window if kind == "sliding_attention" else None
        self.q_proj = nn.Linear(c.hidden_size, self.num_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(c.hidden_size, self.num_kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(c.hidden_size, self.num_kv_heads * self.v_head_dim, bias=False)
        self.o_proj = nn.Linear(self.num_heads * self.v_head_dim, c.hidden_size, bias=False)
        if self.window is not None:
            self.attention_sink_bias = nn.Parameter(torch.zeros(self.num_heads))

    def forward(self, x: torch.Tensor, pos: Positions, cache: KVCache | None = None) -> tuple[torch.Tensor, None]:
        """x [B, T, H] at positions pos -> ([B, T, H], None); keys/values go into `cache` at those positions."""
        B, T, _ = x.shape
        D = self.head_dim
        q, k, v = project(self, x, "q_proj", "k_proj", "v_proj")
        q = q.view(B, T, self.num_heads, D).transpose(1, 2)
        k = k.view(B, T, self.num_kv_heads, D).transpose(1, 2)
        v = (v.view(B, T, self.num_kv_heads, self.v_head_dim) * self.value_scale).transpose(1, 2)
        cos, sin = (pos.cos, pos.sin) if pos.rotary_by_kind is None else pos.rotary_by_kind[self.kind]
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if self.window is None:
            out = attend(q, k, v, cache, pos, D**-0.5)
        else:
            out = attend_window(q, k, v, cache, pos, D**-0.5, self.window, self.attention_sink_bias)
        return self.o_proj(out.transpose(1, 2).reshape(B, T, self.num_heads * self.v_head_dim)), None

    def new_state(self, batch: int, max_len: int, dtype: torch.dtype, device: torch.device | str) -> KVCache:
        return KVCache.allocate(batch, self.num_kv_heads, max_len, self.head_dim, self.v_head_dim, dtype, device)


def feed_forward(config: MiMoV2FlashConfig, i: int) -> nn.Module:
    """Layer i's MLP (MTP layers: i >= num_hidden_layers, dense): SwiGLU or the routed MoE (`is_moe_layer`)."""
    c = config
    if not c.is_moe_layer(i):
        return MLP(c.hidden_size, c.intermediate_size)
    return DeepseekMoE(c.hidden_size, c.n_routed_experts, c.num_experts_per_tok, c.moe_intermediate_size, 0, c.n_group,
                       c.topk_group, c.norm_topk_prob, c.scaling_factor)


class MiMoV2MTPLayer(DecoderLayer):
    """One MTP layer (`model.mtp.layers.{i}`): `enorm`, `hnorm`, `eh_proj`, a sliding-window decoder layer with a dense
    MLP, `final_layernorm` (see the module docstring for the equations)."""

    head = None  # the backbone's lm_head serves every depth

    def __init__(self, config: MiMoV2FlashConfig):
        c = config
        norm = lambda: PlainRMSNorm(c.hidden_size, c.norm_eps)  # noqa: E731
        super().__init__("self_attn", MiMoV2Attention(c, "sliding_attention"), MLP(c.hidden_size, c.intermediate_size), norm)
        self.embed_tokens = None  # the backbone's embedding serves every depth
        self.enorm = norm()
        self.hnorm = norm()
        self.eh_proj = nn.Linear(2 * c.hidden_size, c.hidden_size, bias=False)
        self.final_layernorm = norm()

    def combine(self, emb: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        return self.eh_proj(torch.cat([self.enorm(emb), self.hnorm(hidden)], dim=-1))

    def finish(self, x: torch.Tensor) -> torch.Tensor:
        return self.final_layernorm(x)


class MiMoV2FlashForCausalLM(CausalLM):
    """Backbone + output head + the MTP layers (`mtp`, None when the checkpoint holds none). The routed experts are
    read per expert or fused and written back as read; the router stays fp32 (as transformers keeps it)."""

    config_class = MiMoV2FlashConfig
    fp32_parameters = ("mlp.gate.weight", "mlp.gate.e_score_correction_bias")
    experts_key = "n_routed_experts"
    mtp_input_projection = "eh_proj"  # (stays unquantised: `CausalLM.precise_layers`)

    # ------------------------------------------------------------------ checkpoint names
    @staticmethod
    def internal_name(name: str, config: MiMoV2FlashConfig | None = None) -> str | None:
        """Checkpoint tensor name -> ours: `model.mtp.layers.{i}.*` -> `mtp.layers.{i}.*` (`pre_mlp_layernorm` ->
        `post_attention_layernorm`)."""
        m = CKPT_MTP.match(name)
        if m is None:
            return name
        rest = MLP_NORM + m[2][len(CKPT_MLP_NORM):] if m[2].startswith(CKPT_MLP_NORM) else m[2]
        return f"mtp.layers.{m[1]}.{rest}"

    @staticmethod
    def checkpoint_name(name: str, config: MiMoV2FlashConfig | None = None) -> str:
        """Our parameter name -> the checkpoint's."""
        m = MTP_LAYER.match(name)
        if m is None:
            return name
        rest = CKPT_MLP_NORM + m[2][len(MLP_NORM):] if m[2].startswith(MLP_NORM) else m[2]
        return f"model.mtp.layers.{m[1]}.{rest}"

    @staticmethod
    def mtp_tensor_pattern(config: MiMoV2FlashConfig) -> str:
        return "model.mtp.layers.*"

    @classmethod
    def checkpoint_config(cls, config: MiMoV2FlashConfig, names: list[str]) -> MiMoV2FlashConfig:
        """A file without `num_nextn_predict_layers` (the released one) gets the count of MTP layers the tensors hold."""
        found = {int(m[1]) for n in names if (m := CKPT_MTP.match(n))}
        if not found or config.in_file("num_nextn_predict_layers"):
            return config
        c = copy.deepcopy(config)
        c.num_nextn_predict_layers = max(found) + 1
        return c

    # ------------------------------------------------------------------ modules
    def __init__(self, config: MiMoV2FlashConfig, with_mtp: bool | None = None):
        super().__init__()
        self.config = c = config
        norm = lambda: PlainRMSNorm(c.hidden_size, c.norm_eps)  # noqa: E731
        layers = [DecoderLayer("self_attn", MiMoV2Attention(c, c.layer_type(i)), feed_forward(c, i), norm)
                  for i in range(c.num_hidden_layers)]
        self.model = Backbone(nn.Embedding(c.vocab_size, c.hidden_size), layers, norm())
        self.lm_head = self.output_head(c.tie_word_embeddings)
        self.mtp = self.new_mtp_module() if with_mtp is not False and c.num_nextn_predict_layers > 0 else None
        self.rotaries: dict[str, RotaryTable] = {kind: rotary_table(c.rope_for(kind), c.head_dim, c.max_position_embeddings)
                                                 for kind in KINDS}
        self.rotary = self.rotaries["full_attention"]

    def new_mtp_module(self) -> NextNMTP:
        return NextNMTP([MiMoV2MTPLayer(self.config) for _ in range(self.config.num_nextn_predict_layers)])

    # ------------------------------------------------------------------ positions: one rotary table per layer kind
    def positions(self, start: int, length: int) -> Positions:
        tables = {kind: r(start, length, self.dtype, self.device) for kind, r in self.rotaries.items()}
        return Positions(start, length, *tables["full_attention"], rotary_by_kind=tables)

    def decode_positions(self, index: torch.Tensor, starts: list[int] | None = None) -> Positions:
        tables = {kind: r.gather(index, self.dtype) for kind, r in self.rotaries.items()}
        return Positions(0, index.shape[1], *tables["full_attention"], starts=starts, index=index, rotary_by_kind=tables)

    def prepare_decode(self, max_len: int) -> None:
        for r in self.rotaries.values():
            r.ensure(max_len, self.dtype, self.device)

    @torch.no_grad()
    def init_weights(self, std: float | None = None, modules: nn.Module | None = None) -> None:
        """Initialise for training from scratch (all of the model, or only `modules`) as transformers does
        (`nextn.normal_init`, and normal(0, std) sink logits)."""
        std = self.config.initializer_range if std is None else std
        scope = modules or self
        normal_init(scope, std)
        for m in scope.modules():
            if isinstance(m, MiMoV2Attention) and m.window is not None:
                nn.init.normal_(m.attention_sink_bias, 0.0, std)
