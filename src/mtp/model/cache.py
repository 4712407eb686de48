"""Decode state: preallocated attention KV addressed by position, Gated DeltaNet conv + recurrent state.

Rollback is an index move: attention entries past the accepted length are simply overwritten later,
and a verify step records the DeltaNet state after every verified position so the state after the
accepted prefix is selected, never recomputed.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..config import Qwen35Config
from .deltanet import state_at


@dataclass
class AttnCache:
    k: torch.Tensor  # [B, Hk, S, D]
    v: torch.Tensor  # [B, Hk, S, D]


@dataclass
class DeltaCache:
    conv: torch.Tensor  # [B, C, kernel-1]: the last conv inputs
    ssm: torch.Tensor  # [B, Hv, Kd, Vd] fp32
    # Filled by a recording (verify) forward of q tokens: conv inputs [B, C, kernel-1+q] and the states after
    # each of the q positions, in the factored form of `deltanet.verify_gated_delta_rule`.
    window: torch.Tensor | None = None
    states: tuple[torch.Tensor, ...] | None = None


class Cache:
    """Per-layer decode state for one sequence batch; `pos` = tokens already consumed."""

    def __init__(self, layers: list[AttnCache | DeltaCache], max_len: int):
        self.layers = layers
        self.max_len = max_len
        self.pos = 0
        self.record = False  # set by verify: DeltaNet layers keep the state after every position
        self._pending = 0

    @classmethod
    def allocate(
        cls,
        config: Qwen35Config,
        layer_types: list[str],
        batch: int,
        max_len: int,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
    ) -> Cache:
        c = config
        layers: list[AttnCache | DeltaCache] = []
        conv_dim = 2 * c.linear_key_head_dim * c.linear_num_key_heads + c.linear_value_head_dim * c.linear_num_value_heads
        for kind in layer_types:
            if kind == "full_attention":
                shape = (batch, c.num_key_value_heads, max_len, c.head_dim)
                layers.append(AttnCache(torch.zeros(shape, dtype=dtype, device=device),
                                        torch.zeros(shape, dtype=dtype, device=device)))
            else:
                layers.append(DeltaCache(
                    torch.zeros(batch, conv_dim, c.linear_conv_kernel_dim - 1, dtype=dtype, device=device),
                    torch.zeros(batch, c.linear_num_value_heads, c.linear_key_head_dim, c.linear_value_head_dim,
                                dtype=torch.float32, device=device),
                ))
        return cls(layers, max_len)

    def check_room(self, n: int) -> None:
        if self.pos + n > self.max_len:
            raise ValueError(f"cache holds {self.max_len} positions; cannot add {n} at position {self.pos}")

    def begin_verify(self, q: int) -> None:
        """Next forward (q tokens) records per-position DeltaNet states for `accept`."""
        self.record = True
        self._pending = q

    def accept(self, n: int) -> None:
        """Keep the first n (1 <= n <= q) of the q tokens of the last recorded forward; drop the rest."""
        q = self._pending
        if not 1 <= n <= q:
            raise ValueError(f"accept({n}) after a verify of {q} tokens")
        for layer in self.layers:
            if isinstance(layer, DeltaCache) and layer.window is not None:
                if n < q:
                    width = layer.conv.shape[-1]
                    layer.conv.copy_(layer.window[:, :, n : n + width])
                    layer.ssm.copy_(state_at(layer.states, n))
                layer.window = layer.states = None
        self.pos -= q - n
        self.record = False
        self._pending = 0
