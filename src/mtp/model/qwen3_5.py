"""Qwen3.5 (dense): Gated DeltaNet + gated-attention backbone and its MTP module, under the checkpoint's names.

Backbone `model.embed_tokens`, `model.layers.{i}` (`linear_attn` or `self_attn`, `mlp`, two norms), `model.norm`,
`lm_head` (tied to the embedding when `tie_word_embeddings`). MTP `mtp.*` (docs/reference.md, "The MTP module"):

Sequential (Qwen3.5 / DeepSeek-V3, the default), for depth d at position i:
    e = pre_fc_norm_embedding(embed(t_{i+d})),  h = pre_fc_norm_hidden(h^{d-1}_i)
    h^d_i = norm(layers[(d-1) % L](fc([e; h])))      -> logits of t_{i+d+1} = lm_head(h^d_i)
h^0 is the backbone's hidden state after its final norm; embedding first in the concat, as in every
released checkpoint. Positions: the MTP layer gives slot i the position of h_i (as vLLM does).

Parallel (Meta, Gloeckle et al. 2024; `mtp_style: parallel`, an mtp extension): head d is an independent
layer on h^0,  h^d_i = norm(layers[d-1](h^0_i)) -> logits of t_{i+d+1}; no embedding input, no chain.

Dedicated embeddings (`mtp_use_dedicated_embeddings: true`, no public checkpoint uses it): the module owns
`mtp.embed_tokens.weight [V, H]` and `mtp.lm_head.weight [V, H]` instead of sharing the backbone's.
"""

from __future__ import annotations

import torch
from torch import nn

from ..config import Qwen35Config, Qwen35MoeConfig
from . import step
from .attention import GatedAttention
from .base import CausalLM, MTPModule, PickRule
from .cache import Cache, KVCache, Positions
from .deltanet import GatedDeltaNet
from .layer import MLP, DecoderLayer
from .moe import Experts, SparseMoE, load_balancing_loss
from .norm import RMSNorm, RMSNormGated
from .rope import rotary_table


def feed_forward(config: Qwen35Config) -> nn.Module:
    """The layers' MLP: SwiGLU, or for Qwen3.5-MoE the sparse MoE block with its shared expert."""
    c = config
    if isinstance(c, Qwen35MoeConfig):
        return SparseMoE(c.hidden_size, c.num_experts, c.num_experts_per_tok, c.moe_intermediate_size,
                         c.shared_expert_intermediate_size)
    return MLP(c.hidden_size, c.intermediate_size)


def decoder_layer(config: Qwen35Config, kind: str) -> DecoderLayer:
    """A Qwen3.5 decoder layer of `kind` 'full_attention' (`self_attn`) or 'linear_attention' (`linear_attn`)."""
    c = config
    mixer = ("self_attn", GatedAttention(c)) if kind == "full_attention" else ("linear_attn", GatedDeltaNet(c))
    return DecoderLayer(*mixer, feed_forward(c), lambda: RMSNorm(c.hidden_size, c.rms_norm_eps))


class Qwen35TextModel(nn.Module):
    """The backbone: `model.embed_tokens`, `model.layers.{i}`, `model.norm`."""

    def __init__(self, config: Qwen35Config):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList([decoder_layer(config, config.layer_type(i)) for i in range(config.num_hidden_layers)])
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class Qwen35MTP(MTPModule):
    """The MTP module `mtp.*` (both schools; see the module docstring)."""

    def __init__(self, config: Qwen35Config, layer=None):
        """`layer(i)`: MTP layer i (default: a Qwen3.5 full-attention decoder layer with the config's MLP)."""
        super().__init__()
        c = config
        layer = layer or (lambda i: decoder_layer(c, "full_attention"))
        self.style = c.mtp_style
        if self.style == "sequential":
            self.pre_fc_norm_embedding = RMSNorm(c.hidden_size, c.rms_norm_eps)
            self.pre_fc_norm_hidden = RMSNorm(c.hidden_size, c.rms_norm_eps)
            self.fc = nn.Linear(2 * c.hidden_size, c.hidden_size, bias=False)
        self.layers = nn.ModuleList([layer(i) for i in range(c.mtp_num_hidden_layers)])
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        own = c.mtp_use_dedicated_embeddings
        self.embed_tokens = nn.Embedding(c.vocab_size, c.hidden_size) if own else None
        self.lm_head = nn.Linear(c.hidden_size, c.vocab_size, bias=False) if own else None

    @property
    def max_depth(self) -> int | None:
        """Deepest draft step the module supports (None: any, layers reused cyclically)."""
        return self.num_layers if self.style == "parallel" else None

    def layer_for_depth(self, d: int) -> int:
        """Index of the layer that serves depth d (1-based): head d - 1 (parallel), else reused cyclically."""
        if self.style == "parallel":
            if d > self.num_layers:
                raise ValueError(f"parallel MTP has {self.num_layers} heads; depth {d} asked")
            return d - 1
        return super().layer_for_depth(d)

    def embed_for_depth(self, d: int) -> nn.Module | None:
        return self.embed_tokens

    def head_for_depth(self, d: int) -> nn.Module | None:
        return self.lm_head

    def step(self, d: int, hidden: torch.Tensor, emb: torch.Tensor | None, pos: Positions,
             cache: KVCache | None = None) -> torch.Tensor:
        """One depth: h^{d-1} [B, T, H] (+ emb of the next tokens [B, T, H]) -> h^d [B, T, H]."""
        x = self.layer_input(hidden, emb)
        i = self.layer_for_depth(d)
        if pos.decoding and (done := step.mtp_layer(self, i, x, cache, pos)) is not None:  # one C call: the same bits
            return done
        x, _ = self.layers[i](x, pos, cache)
        return self.norm(x)

    def fill(self, d: int, hidden: torch.Tensor, emb: torch.Tensor | None, pos: Positions, cache: KVCache) -> None:
        """`MTPModule.fill`: the layer's keys and values only (an MTP layer is a full-attention layer): the input
        projection, the layer's input norm and its attention's key/value projection, not the attention, its output
        or the MLP (a prompt's read of the shipped model's MTP: ~2.9x fewer products)."""
        layer = self.layers[self.layer_for_depth(d)]
        layer.self_attn.fill(layer.input_layernorm(self.layer_input(hidden, emb)), pos, cache)

    def layer_input(self, hidden: torch.Tensor, emb: torch.Tensor | None) -> torch.Tensor:
        """A depth's layer input [B, T, H]: fc([norm(emb); norm(h^{d-1})]) (sequential), h^0 itself (parallel heads)."""
        if self.style != "sequential":
            return hidden
        return self.fc(torch.cat([self.pre_fc_norm_embedding(emb), self.pre_fc_norm_hidden(hidden)], dim=-1))


class Qwen35ForCausalLM(CausalLM):
    """Backbone + output head + MTP module (`mtp`, None when the checkpoint has no usable MTP).

    Checkpoints: text-only (`model.*`, `lm_head.*`, `mtp.*`) and multimodal (`model.language_model.*`, with
    `model.visual.*` ignored) are read; the text-only layout with a flat `qwen3_5_text` config is written, which
    transformers (`Qwen3_5ForCausalLM`), vLLM and llama.cpp read; our names are the checkpoint's."""

    config_class = Qwen35Config
    native_bf16 = ("mtp.fc",)  # the one-call draft runs it (step.py)

    @staticmethod
    def internal_name(name: str, config: Qwen35Config | None = None) -> str | None:
        """Checkpoint tensor name -> our parameter name (None: not part of the text model)."""
        if name.startswith("model.visual.") or name.startswith("visual."):
            return None
        if name.startswith("model.language_model."):
            return "model." + name[len("model.language_model."):]
        return name

    @staticmethod
    def mtp_tensor_pattern(config: Qwen35Config) -> str:
        """Where the checkpoint keeps its MTP tensors (for messages)."""
        return "mtp.*"

    def __init__(self, config: Qwen35Config, with_mtp: bool | None = None):
        super().__init__()
        self.config = config
        self.model = Qwen35TextModel(config)
        self.lm_head = self.output_head(config.tie_word_embeddings)
        self.mtp = Qwen35MTP(config) if with_mtp is not False and config.mtp_num_hidden_layers > 0 else None
        self.rotary = rotary_table(config.rope(), config.head_dim, config.max_position_embeddings)

    def hidden(self, ids: torch.Tensor, cache: Cache | None = None, router_logits: list | None = None) -> torch.Tensor:
        """`CausalLM.hidden`; a prefill's chunk as one C call where the backbone allows it (step.py `prefill`)."""
        if cache is not None and router_logits is None and type(self).decode is Qwen35ForCausalLM.decode:
            done = step.prefill(self, ids, cache)
            if done is not None:
                return done
        return super().hidden(ids, cache, router_logits)

    def decode(self, ids: torch.Tensor, cache: Cache, pos: Positions) -> tuple[torch.Tensor, list]:
        """`CausalLM.decode`, as one C call where the backbone and the forward allow it (step.py: the same bits)."""
        done = step.decode(self, ids, cache, pos)
        return done if done is not None else super().decode(ids, cache, pos)

    def mtp_draft(self, K: int, pend_h: torch.Tensor, pend_next: torch.Tensor, pend_n: torch.Tensor,
                  mtp_pos: torch.Tensor, caches: list, width: int, host: tuple[list[int], list[int]],
                  vocab: tuple[nn.Module, torch.Tensor] | None = None,
                  sampling: PickRule | None = None) -> torch.Tensor | None:
        """`CausalLM.mtp_draft`, as one C call where the MTP allows it (step.py: the same drafts and caches)."""
        return step.draft(self, K, pend_h, pend_next, pend_n, mtp_pos, caches, width, host, vocab, sampling)

    def round_program(self, K: int, commit: bool, cache: Cache, mtp_caches: list | None, pos: torch.Tensor,
                      pend_h: torch.Tensor | None, pend_next: torch.Tensor | None, pend_n: torch.Tensor | None,
                      mtp_pos: torch.Tensor | None, vocab: tuple[nn.Module, torch.Tensor] | None = None, scratch=None):
        """`CausalLM.round_program` (step.py), for this class's own head and decode forward."""
        cls = type(self)
        if any(getattr(cls, f) is not getattr(Qwen35ForCausalLM, f) for f in ("head", "decode", "mtp_draft")):
            return None
        return step.round_program(self, K, commit, cache, mtp_caches, pos, pend_h, pend_next, pend_n, mtp_pos, vocab,
                                  scratch)

    def prepare_for_inference(self, *args, **kwargs) -> None:
        """`CausalLM.prepare_for_inference`; the one-call decode forward is then built anew (step.py)."""
        super().prepare_for_inference(*args, **kwargs)
        step.forget(self)

    def quantize_drafts(self, bits: str) -> None:
        """`CausalLM.quantize_drafts`; the one-call draft chain is then built anew (step.py)."""
        super().quantize_drafts(bits)
        step.forget(self)

    def new_mtp_module(self) -> Qwen35MTP:
        """A fresh MTP module for this config (training heads onto a checkpoint that has none)."""
        return Qwen35MTP(self.config)

    @torch.no_grad()
    def init_weights(self, std: float | None = None, modules: nn.Module | None = None) -> None:
        """Initialise for training from scratch (all of the model, or only `modules`): normal(0, std) projections
        and embeddings, Qwen's norms (zero-centred: 0; the gated one: 1), DeltaNet's decay parameters."""
        std = self.config.initializer_range if std is None else std
        for m in (modules or self).modules():
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, 0.0, std)
            elif isinstance(m, nn.Conv1d):
                nn.init.kaiming_uniform_(m.weight, a=5**0.5)
            elif isinstance(m, RMSNorm):
                m.weight.zero_()
            elif isinstance(m, RMSNormGated):
                m.weight.fill_(1.0)
            elif isinstance(m, Experts):
                nn.init.normal_(m.gate_up_proj, 0.0, std)
                nn.init.normal_(m.down_proj, 0.0, std)
            if isinstance(m, GatedDeltaNet):
                m.dt_bias.fill_(1.0)
                m.A_log.copy_(torch.empty_like(m.A_log).uniform_(0.01, 16).log())


class Qwen35MoeForCausalLM(Qwen35ForCausalLM):
    """Qwen3.5-MoE: the same model with the sparse MoE block as every layer's MLP (the MTP layer's too).

    Checkpoints hold the experts per expert or fused, per layer, in any combination (docs/families.md); both are
    read into the fused form, and saving writes each layer back in the layout it was read in (per expert, as
    transformers writes, for a new model)."""

    config_class = Qwen35MoeConfig
    experts_key = "num_experts"
    # the routers stay bf16 under int8 too: quantizing them changes which experts run
    keep_precision = ("mlp.gate", "shared_expert_gate")

    def router_aux_loss(self, router_logits: list) -> torch.Tensor | None:
        """router_aux_loss_coef x the load-balancing loss (as transformers computes it) over the collected layers."""
        if not router_logits:
            return None
        c = self.config
        return c.router_aux_loss_coef * load_balancing_loss(router_logits, c.num_experts, c.num_experts_per_tok)

