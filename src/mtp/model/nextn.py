"""DeepSeek-style MTP modules ("next-n" prediction layers): one decoder layer per depth, reused cyclically when more
drafts are asked than there are layers (docs/families.md, "DeepSeek-V3/R1 and GLM-4.5/4.6/4.7", "MiMo-7B"); and the
plain backbone container of the families that use them.

Each layer is a decoder layer with a few more modules; a layer class supplies
- `combine(emb, hidden)`: the embedding of the next tokens [B, T, H] and h^{d-1} [B, T, H] -> the layer input;
- `finish(x)`: the decoder layer's output -> h^d (what the head reads and the next depth is fed);
- `embed_tokens` and `head`: its own embedding and output head, or None (the backbone's are used).
`NextNMTP` holds them and is the family's `base.MTPModule`.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from .base import MTPModule
from .cache import KVCache, Positions
from .layer import DecoderLayer
from .moe import Experts, GroupedTopkRouter
from .norm import PlainRMSNorm


class Backbone(nn.Module):
    """`model.embed_tokens` [V, H], `model.layers.{i}`, `model.norm`."""

    def __init__(self, embed: nn.Embedding, layers: list[nn.Module], norm: nn.Module):
        super().__init__()
        self.embed_tokens = embed
        self.layers = nn.ModuleList(layers)
        self.norm = norm


class SharedHead(nn.Module):
    """`shared_head`: `norm`, and `head` [V, H] when the checkpoint holds one (GLM-4.6 does not)."""

    def __init__(self, norm: nn.Module, head: nn.Module | None):
        super().__init__()
        self.norm = norm
        self.head = head


class NextNLayer(DecoderLayer):
    """A DeepSeek-V3 / GLM MTP layer (`model.layers.{L + i}`): `enorm`, `hnorm`, `eh_proj` [H, 2H], the decoder layer's
    own `input_layernorm`, `self_attn`, `post_attention_layernorm`, `mlp`, then `shared_head.norm`; `embed_tokens`
    and `shared_head.head` when the checkpoint holds them.

    x = eh_proj(cat[enorm(emb), hnorm(h)]) (embedding first); h^d = shared_head.norm(decoder_layer(x)) - the
    post-norm state is what chained drafts feed back (docs/families.md)."""

    def __init__(self, attention: nn.Module, mlp: nn.Module, norm: Callable[[], nn.Module], hidden: int, vocab: int,
                 own_embed: bool, own_head: bool):
        super().__init__("self_attn", attention, mlp, norm)
        self.enorm = norm()
        self.hnorm = norm()
        self.eh_proj = nn.Linear(2 * hidden, hidden, bias=False)
        self.shared_head = SharedHead(norm(), nn.Linear(hidden, vocab, bias=False) if own_head else None)
        self.embed_tokens = nn.Embedding(vocab, hidden) if own_embed else None

    @property
    def head(self) -> nn.Module | None:
        return self.shared_head.head

    def combine(self, emb: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        return self.eh_proj(torch.cat([self.enorm(emb), self.hnorm(hidden)], dim=-1))

    def finish(self, x: torch.Tensor) -> torch.Tensor:
        return self.shared_head.norm(x)


class NextNMTP(MTPModule):
    """The MTP module `mtp.layers.{i}` (sequential: depth d runs layer (d - 1) mod L on h^{d-1} and the embedding
    of the token d ahead)."""

    def __init__(self, layers: list[nn.Module]):
        super().__init__()
        self.layers = nn.ModuleList(layers)

    def embed_for_depth(self, d: int) -> nn.Module | None:
        return self.layers[self.layer_for_depth(d)].embed_tokens

    def head_for_depth(self, d: int) -> nn.Module | None:
        return self.layers[self.layer_for_depth(d)].head

    def step(self, d: int, hidden: torch.Tensor, emb: torch.Tensor | None, pos: Positions,
             cache: KVCache | None = None) -> torch.Tensor:
        """One depth: h^{d-1} [B, T, H] and the embedding of the next tokens [B, T, H] -> h^d [B, T, H]."""
        layer = self.layers[self.layer_for_depth(d)]
        x, _ = layer(layer.combine(emb, hidden), pos, cache)
        return layer.finish(x)


@torch.no_grad()
def normal_init(scope: nn.Module, std: float) -> None:
    """transformers' init for these families, over `scope`'s modules: normal(0, std) weights (experts and router
    too), zero biases, unit plain norms, a zero router selection bias."""
    for m in scope.modules():
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, 0.0, std)
            if getattr(m, "bias", None) is not None:
                m.bias.zero_()
        elif isinstance(m, PlainRMSNorm):
            m.weight.fill_(1.0)
        elif isinstance(m, Experts):
            nn.init.normal_(m.gate_up_proj, 0.0, std)
            nn.init.normal_(m.down_proj, 0.0, std)
        elif isinstance(m, GroupedTopkRouter):
            nn.init.normal_(m.weight, 0.0, std)
            m.e_score_correction_bias.zero_()
