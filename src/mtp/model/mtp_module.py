"""The MTP module (`mtp.*`), both schools.

Sequential (Qwen3.5 / DeepSeek-V3, the default), for depth d at position i:
    e = pre_fc_norm_embedding(embed(t_{i+d})),  h = pre_fc_norm_hidden(h^{d-1}_i)
    h^d_i = norm(layers[(d-1) % L](fc([e; h])))      -> logits of t_{i+d+1} = lm_head(h^d_i)
h^0 is the backbone's hidden state after its final norm; embedding first in the concat, as in every
released checkpoint. Positions: the MTP layer gives slot i the position of h_i (as vLLM does).

Parallel (Meta, Gloeckle et al. 2024; `mtp_style: parallel`): head d is an independent layer on h^0,
    h^d_i = norm(layers[d-1](h^0_i))                   -> logits of t_{i+d+1}
no embedding input and no chain, so all heads draft at once.

Dedicated embeddings (`mtp_use_dedicated_embeddings: true`, no public checkpoint uses it): the module
owns `mtp.embed_tokens.weight [V, H]` and `mtp.lm_head.weight [V, H]` instead of sharing the backbone's.
"""

from __future__ import annotations

import torch
from torch import nn

from ..config import Qwen35Config
from .cache import AttnCache
from .layer import DecoderLayer
from .norm import RMSNorm


class MTPModule(nn.Module):
    def __init__(self, config: Qwen35Config):
        super().__init__()
        c = config
        self.style = c.mtp_style
        self.num_layers = c.mtp_num_hidden_layers
        if self.style == "sequential":
            self.pre_fc_norm_embedding = RMSNorm(c.hidden_size, c.rms_norm_eps)
            self.pre_fc_norm_hidden = RMSNorm(c.hidden_size, c.rms_norm_eps)
            self.fc = nn.Linear(2 * c.hidden_size, c.hidden_size, bias=False)
        self.layers = nn.ModuleList([DecoderLayer(c, "full_attention") for _ in range(c.mtp_num_hidden_layers)])
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        if c.mtp_use_dedicated_embeddings:
            self.embed_tokens = nn.Embedding(c.vocab_size, c.hidden_size)
            self.lm_head = nn.Linear(c.hidden_size, c.vocab_size, bias=False)

    @property
    def max_depth(self) -> int | None:
        """Deepest draft step the module supports (None: any, layers reused cyclically)."""
        return self.num_layers if self.style == "parallel" else None

    def layer_for_depth(self, d: int) -> int:
        """Index of the layer that serves depth d (1-based)."""
        if self.style == "parallel":
            if d > self.num_layers:
                raise ValueError(f"parallel MTP has {self.num_layers} heads; depth {d} asked")
            return d - 1
        return (d - 1) % self.num_layers

    def step(
        self, d: int, hidden: torch.Tensor, emb: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor,
        cache: AttnCache | None = None, pos: int = 0,
    ) -> torch.Tensor:
        """One depth: hidden h^{d-1} [B, T, H] (+ emb of the next tokens [B, T, H]) -> h^d [B, T, H]."""
        if self.style == "sequential":
            x = self.fc(torch.cat([self.pre_fc_norm_embedding(emb), self.pre_fc_norm_hidden(hidden)], dim=-1))
        else:
            x = hidden
        x = self.layers[self.layer_for_depth(d)](x, cos, sin, cache, pos)
        return self.norm(x)
