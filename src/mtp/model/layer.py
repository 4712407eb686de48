"""The pre-norm decoder layer (mixer + MLP, each with a residual) and the SwiGLU MLP, shared by every family.

A mixer is any module with `forward(x, pos, cache) -> (out, decode steps | None)` and
`new_state(batch, max_len, dtype, device)`: gated attention, Gated DeltaNet, MLA, plain GQA attention.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from . import act
from .cache import Positions
from .linear import project
from .rowwise import rowwise


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x)); [..., H] -> [..., H]."""

    fused_projections = ("gate_proj", "up_proj")  # one matmul at inference (`linear.project`)

    def __init__(self, hidden: int, intermediate: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = project(self, x, "gate_proj", "up_proj")
        if act.usable(gate, up):  # inference on a CPU: one C call, the same roundings
            return self.down_proj(act.silu_mul(gate, up))
        return self.down_proj(rowwise(F.silu, gate) * up)


class DecoderLayer(nn.Module):
    """`x + mixer(input_layernorm(x))`, then `x + mlp(post_attention_layernorm(x))`.

    The mixer is registered under the checkpoint's own name (`self_attn` or `linear_attn`), so parameter
    names are the checkpoint's."""

    def __init__(self, mixer_name: str, mixer: nn.Module, mlp: nn.Module, norm: Callable[[], nn.Module]):
        super().__init__()
        self.mixer_name = mixer_name
        self.add_module(mixer_name, mixer)
        self.mlp = mlp
        self.input_layernorm = norm()
        self.post_attention_layernorm = norm()

    @property
    def mixer(self) -> nn.Module:
        return getattr(self, self.mixer_name)

    def forward(self, x: torch.Tensor, pos: Positions, cache=None):
        """x [B, T, H] at positions pos.start.. -> ([B, T, H], the mixer's snapshot or None).

        An MoE mlp returns (out, router logits); the logits go to `pos.router_logits` when the forward collects
        them (training: the load-balancing loss)."""
        h, snap = self.mixer(self.input_layernorm(x), pos, cache)
        x = x + h
        out = self.mlp(self.post_attention_layernorm(x))
        if isinstance(out, tuple):
            out, logits = out
            if pos.router_logits is not None:
                pos.router_logits.append(logits)
        return x + out, snap

    def new_state(self, batch: int, max_len: int, dtype: torch.dtype, device: torch.device | str):
        return self.mixer.new_state(batch, max_len, dtype, device)
