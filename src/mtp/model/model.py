"""Qwen3.5 text model with its MTP module: `Qwen35ForCausalLM` (tensor names = the HF checkpoint's)."""

from __future__ import annotations

import torch
from torch import nn

from ..config import Qwen35Config
from .cache import AttnCache, Cache
from .deltanet import GatedDeltaNet
from .layer import DecoderLayer
from .mtp_module import MTPModule
from .norm import RMSNorm, RMSNormGated
from .rope import rope_cos_sin, rope_inv_freq


class Qwen35TextModel(nn.Module):
    """The backbone: `model.embed_tokens`, `model.layers.{i}`, `model.norm`."""

    def __init__(self, config: Qwen35Config):
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList([DecoderLayer(config, kind) for kind in config.layer_types])
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: Cache | None = None,
                checkpoint: bool = False) -> torch.Tensor:
        """Embedded input [B, T, H] -> hidden after the final norm [B, T, H]."""
        pos = 0 if cache is None else cache.pos
        record = cache is not None and cache.record
        for i, layer in enumerate(self.layers):
            lc = None if cache is None else cache.layers[i]
            if checkpoint and self.training:
                x = torch.utils.checkpoint.checkpoint(layer, x, cos, sin, use_reentrant=False)
            else:
                x = layer(x, cos, sin, lc, pos, record)
        return self.norm(x)


class Qwen35ForCausalLM(nn.Module):
    """Backbone + output head + MTP module (`mtp`, None when the checkpoint has no usable MTP)."""

    def __init__(self, config: Qwen35Config, with_mtp: bool | None = None):
        super().__init__()
        self.config = config
        self.model = Qwen35TextModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        if with_mtp is None:
            with_mtp = config.mtp_num_hidden_layers > 0
        self.mtp = MTPModule(config) if with_mtp and config.mtp_num_hidden_layers > 0 else None
        self.register_buffer("inv_freq", rope_inv_freq(config.rotary_dim, config.rope_theta), persistent=False)
        self.gradient_checkpointing = False
        self.tokenizer = None  # set by load_model when the folder has tokenizer.json
        self._rope_table: tuple[torch.Tensor, torch.Tensor] | None = None

    # ------------------------------------------------------------------ basics
    @property
    def has_mtp(self) -> bool:
        """True when the model holds trained (loaded or initialised-for-training) MTP weights."""
        return self.mtp is not None

    @property
    def dtype(self) -> torch.dtype:
        return self.model.embed_tokens.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.model.embed_tokens.weight.device

    def rope(self, start: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [length, rotary_dim] for positions start..start+length-1 (slices of a cached table, so
        a decode step allocates nothing here)."""
        end = start + length
        table = self._rope_table
        if table is None or table[0].shape[0] < end or table[0].dtype != self.dtype or table[0].device != self.inv_freq.device:
            n = max(end, 2 * (0 if table is None else table[0].shape[0]), 1024)
            # a normal tensor even when first built under inference_mode, so training can reuse it
            with torch.inference_mode(False), torch.no_grad():
                positions = torch.arange(n, device=self.inv_freq.device)
                table = self._rope_table = rope_cos_sin(positions, self.inv_freq.clone(), self.dtype)
        return table[0][start:end], table[1][start:end]

    def embed(self, input_ids: torch.Tensor, for_mtp: bool = False) -> torch.Tensor:
        """[B, T] -> [B, T, H] (the MTP's own table when it has dedicated embeddings)."""
        if for_mtp and self.mtp is not None and hasattr(self.mtp, "embed_tokens"):
            return self.mtp.embed_tokens(input_ids)
        return self.model.embed_tokens(input_ids)

    def head(self, hidden: torch.Tensor, for_mtp: bool = False) -> torch.Tensor:
        """[..., H] -> logits [..., V] (the MTP's own head when it has dedicated embeddings)."""
        if for_mtp and self.mtp is not None and hasattr(self.mtp, "lm_head"):
            return self.mtp.lm_head(hidden)
        return self.lm_head(hidden)

    def hidden(self, input_ids: torch.Tensor, cache: Cache | None = None) -> torch.Tensor:
        """Backbone hidden after the final norm: [B, T] -> [B, T, H]. Advances `cache.pos` by T."""
        T = input_ids.shape[1]
        pos = 0 if cache is None else cache.pos
        if cache is not None:
            cache.check_room(T)
        cos, sin = self.rope(pos, T)
        h = self.model(self.model.embed_tokens(input_ids), cos, sin, cache, self.gradient_checkpointing)
        if cache is not None:
            cache.pos += T
        return h

    def forward(self, input_ids: torch.Tensor, cache: Cache | None = None) -> torch.Tensor:
        """Backbone logits: [B, T] -> [B, T, V]."""
        return self.head(self.hidden(input_ids, cache))

    def new_cache(self, batch: int, max_len: int) -> Cache:
        """Preallocated backbone decode state for `max_len` positions."""
        max_len = min(max_len, self.config.max_position_embeddings)
        return Cache.allocate(self.config, self.config.layer_types, batch, max_len, self.dtype, self.device)

    def new_mtp_cache(self, batch: int, max_len: int) -> list[AttnCache]:
        """One preallocated KV cache per MTP layer."""
        assert self.mtp is not None
        c = self.config
        max_len = min(max_len, c.max_position_embeddings)
        shape = (batch, c.num_key_value_heads, max_len, c.head_dim)
        return [AttnCache(torch.zeros(shape, dtype=self.dtype, device=self.device),
                          torch.zeros(shape, dtype=self.dtype, device=self.device)) for _ in self.mtp.layers]

    # ------------------------------------------------------------------ generation
    def generate(self, input_ids, **kwargs):
        """See `mtp.decode.generate`: tokens, text, finish reason and statistics for one sequence."""
        from ..decode import generate

        return generate(self, input_ids, **kwargs)

    def stream(self, input_ids, **kwargs):
        """See `mtp.decode.stream`: iterate over the tokens emitted at each step."""
        from ..decode import stream

        return stream(self, input_ids, **kwargs)

    # ------------------------------------------------------------------ MTP, teacher forced
    def mtp_hidden_states(self, input_ids: torch.Tensor, depth: int | None = None,
                          hidden: torch.Tensor | None = None):
        """Yield h^d [B, T-d, H] for d = 1..depth, teacher-forced with the true tokens.

        Position i of depth d predicts token i+d+1. `hidden` (the backbone's [B, T, H]) is computed when
        not given. A generator so that a trainer can take the loss depth by depth.
        """
        if self.mtp is None:
            raise RuntimeError("this model has no MTP module (the checkpoint held no mtp.* tensors)")
        depth = self.config.mtp_num_hidden_layers if depth is None else depth
        max_depth = self.mtp.max_depth
        if depth < 1 or (max_depth is not None and depth > max_depth):
            raise ValueError(f"depth must be in 1..{max_depth or 'any'}, got {depth}")
        T = input_ids.shape[1]
        if depth >= T:
            raise ValueError(f"depth {depth} needs sequences longer than {T} tokens")
        h0 = self.hidden(input_ids) if hidden is None else hidden
        prev = h0
        for d in range(1, depth + 1):
            n = T - d
            cos, sin = self.rope(0, n)
            if self.mtp.style == "sequential":
                emb = self.embed(input_ids[:, d:], for_mtp=True)
                out = self.mtp.step(d, prev[:, :n], emb, cos, sin)
                prev = out
            else:
                out = self.mtp.step(d, h0[:, :n], None, cos, sin)
            yield out

    def mtp_logits(self, input_ids: torch.Tensor, depth: int | None = None) -> list[torch.Tensor]:
        """List over d = 1..depth of [B, T-d, V]: position i predicts token i+d+1 (teacher forcing)."""
        return [self.head(h, for_mtp=True) for h in self.mtp_hidden_states(input_ids, depth)]


def init_weights_(model: Qwen35ForCausalLM, std: float | None = None, seed: int | None = None) -> None:
    """Initialise for training from scratch: normal(0, std) projections and embeddings, Qwen's norms."""
    if seed is not None:
        torch.manual_seed(seed)
    std = model.config.initializer_range if std is None else std
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, 0.0, std)
            elif isinstance(m, nn.Conv1d):
                nn.init.kaiming_uniform_(m.weight, a=5**0.5)
            elif isinstance(m, RMSNorm):
                m.weight.zero_()
            elif isinstance(m, RMSNormGated):
                m.weight.fill_(1.0)
            if isinstance(m, GatedDeltaNet):
                m.dt_bias.fill_(1.0)
                m.A_log.copy_(torch.empty_like(m.A_log).uniform_(0.01, 16).log())


__all__ = ["Qwen35ForCausalLM", "Qwen35TextModel", "init_weights_"]
