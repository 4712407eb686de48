"""Partial rotary position embedding (rotate-half style) on the first `rotary_dim` dims of each head."""

import torch


def rope_inv_freq(rotary_dim: int, theta: float) -> torch.Tensor:
    """[rotary_dim // 2] inverse frequencies, fp32, on the CPU (also when built under a meta-device context)."""
    return 1.0 / (theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.float32, device="cpu") / rotary_dim))


def rope_cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """positions [T] -> cos, sin [T, rotary_dim].

    Text-only Qwen3.5 gives all three M-RoPE sections the same position id, which is plain 1-D RoPE.
    """
    freqs = positions.float()[:, None] * inv_freq[None, :]
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B, H, T, D], cos/sin [T, R] with R <= D -> [B, H, T, D]; dims R.. pass through."""
    r = cos.shape[-1]
    x_rot, x_pass = x[..., :r], x[..., r:]
    x1, x2 = x_rot[..., : r // 2], x_rot[..., r // 2 :]
    rotated = torch.cat([-x2, x1], dim=-1)
    return torch.cat([x_rot * cos + rotated * sin, x_pass], dim=-1)


class RotaryTable:
    """cos/sin [n, R] for positions 0..n-1 (times `scale`, YaRN's attention factor), grown on demand and
    cached for one dtype and device: a decode step slices, it never allocates. Not a module buffer, so a
    model built on the meta device and loaded later needs no fix-up."""

    def __init__(self, inv_freq: torch.Tensor, scale: float = 1.0):
        self.inv_freq = inv_freq.float().cpu()
        self.scale = scale
        self._table: tuple[torch.Tensor, torch.Tensor] | None = None

    def __call__(self, start: int, length: int, dtype: torch.dtype, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        end = start + length
        table = self._table
        if table is None or table[0].shape[0] < end or table[0].dtype != dtype or table[0].device != device:
            n = max(end, 2 * (0 if table is None else table[0].shape[0]), 1024)
            # a normal tensor even when first built under inference_mode, so training can reuse it
            with torch.inference_mode(False), torch.no_grad():
                freqs = torch.arange(n, dtype=torch.float32, device="cpu")[:, None] * self.inv_freq[None, :]
                emb = torch.cat([freqs, freqs], dim=-1)
                cos, sin = emb.cos(), emb.sin()
                if self.scale != 1.0:
                    cos, sin = cos * self.scale, sin * self.scale
                table = self._table = (cos.to(dtype=dtype, device=device), sin.to(dtype=dtype, device=device))
        return table[0][start:end], table[1][start:end]
