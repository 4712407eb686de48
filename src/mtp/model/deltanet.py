"""Gated DeltaNet (linear attention) of Qwen3.5.

Per value head, with state S [Kd, Vd]:  S <- S * exp(g);  delta = beta * (v - k^T S);  S <- S + k delta^T;
o = q^T S.  Two forms: a chunked (parallel within chunks) form for prefill and training, and a recurrent
form for decoding and verification; a decode forward keeps the state after every position (`cache.DeltaSteps`)
and `Cache.keep_at` selects one. On x86 CPUs a decode forward runs as one C call from the conv window to the gated
norm (deltanet_kernel.py), and so does a bf16 prompt's chunk (its tokens as plain steps, the state updated in place);
the torch forms below are the same arithmetic for other devices and machines.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..config import Qwen35Config
from . import deltanet_kernel
from .cache import DeltaState, DeltaSteps, Positions
from .linear import packed_bf16_supported, project
from .norm import RMSNormGated
from .rowwise import rowwise


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def chunk_gated_delta_rule(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
    initial_state: torch.Tensor | None = None, chunk_size: int = 64,
) -> tuple[torch.Tensor, torch.Tensor]:
    """q, k [B, H, T, Kd] (normalised, q scaled), v [B, H, T, Vd], g, beta [B, H, T]; all fp32.

    Returns o [B, H, T, Vd] and the final state [B, H, Kd, Vd]. Within a chunk the delta-rule updates
    are solved at once with a unit-lower-triangular system (the WY/UT form); chunks are scanned in order.
    """
    B, H, T, Kd = k.shape
    Vd = v.shape[-1]
    C = chunk_size
    pad = (C - T % C) % C
    if pad:
        q, k, v = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, v))
        g, beta = (F.pad(x, (0, pad)) for x in (g, beta))
    n = (T + pad) // C
    q, k, v = (x.reshape(B, H, n, C, x.shape[-1]) for x in (q, k, v))
    g, beta = g.reshape(B, H, n, C), beta.reshape(B, H, n, C)

    gc = g.cumsum(-1)  # log decay from chunk start to each position
    causal = torch.ones(C, C, dtype=torch.bool, device=q.device).tril()
    # decay[i, j] = exp(gc_i - gc_j) for j <= i
    decay = (gc[..., :, None] - gc[..., None, :]).masked_fill(~causal, float("-inf")).exp()
    kb, vb = k * beta[..., None], v * beta[..., None]
    # Solve (I + A) x = b with A[i, j] = beta_i k_i.k_j decay[i, j] for j < i; `unitriangular` makes the
    # solver read only the strictly lower part, so the diagonal and the (zero) upper part need no masking.
    system = (kb @ k.transpose(-1, -2)) * decay
    u = torch.linalg.solve_triangular(system, vb, upper=False, unitriangular=True)  # new values
    w = torch.linalg.solve_triangular(system, kb * gc.exp()[..., None], upper=False, unitriangular=True)
    attn = (q @ k.transpose(-1, -2)) * decay  # intra-chunk, includes the diagonal
    q_dec = q * gc.exp()[..., None]
    k_dec = k * (gc[..., -1:] - gc).exp()[..., None]
    chunk_decay = gc[..., -1].exp()[..., None, None]

    S = q.new_zeros(B, H, Kd, Vd) if initial_state is None else initial_state.to(q.dtype)
    outs = []
    for i in range(n):
        v_new = u[:, :, i] - w[:, :, i] @ S
        outs.append(q_dec[:, :, i] @ S + attn[:, :, i] @ v_new)
        S = S * chunk_decay[:, :, i] + k_dec[:, :, i].transpose(-1, -2) @ v_new
    o = torch.stack(outs, dim=2).reshape(B, H, n * C, Vd)[:, :, :T]
    return o, S


def recurrent_gated_delta_rule(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, state: torch.Tensor,
    keep_states: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """One token at a time (decoding, and verification). Same shapes as the chunked form; state [B, H, Kd, Vd]
    fp32. Returns o [B, H, T, Vd], the final state, and with `keep_states` the state after every token
    [B, H, T, Kd, Vd] (for rollback).

    A verify block runs exactly this per-token arithmetic, as a plain step does, so each verified position's output
    is bit-identical to plain decoding's whatever the block length - which keeps greedy speculative decoding
    identical to plain decoding in bf16 and int8 too (docs/decisions.md, 2026-11-30 speed)."""
    outs, states = [], []
    S = state
    # time-major contiguous copies: every step's operands then have the same layout whatever T is, so the per-step
    # matmuls take the same kernel path and a verified position's state is bit-identical to a plain step's
    q, k, v = (x.permute(2, 0, 1, 3).contiguous() for x in (q, k, v))  # [T, B, H, d]
    decay, beta = (x.permute(2, 0, 1).contiguous() for x in (rowwise(torch.exp, g), beta))  # [T, B, H]
    for t in range(q.shape[0]):
        S = S * decay[t][..., None, None]
        kt = k[t]
        kv = (kt.unsqueeze(-2) @ S).squeeze(-2)  # k^T S: [B, H, Vd]
        delta = (v[t] - kv) * beta[t][..., None]
        S = S + kt.unsqueeze(-1) * delta.unsqueeze(-2)
        if keep_states:
            states.append(S)
        outs.append((q[t].unsqueeze(-2) @ S).squeeze(-2))
    if not keep_states:
        return torch.stack(outs, dim=2), S, None
    # one token (a plain step): a view of the state, not a copy - at real size a state is megabytes per layer
    return torch.stack(outs, dim=2), S, states[0].unsqueeze(2) if len(states) == 1 else torch.stack(states, dim=2)


class GatedDeltaNet(nn.Module):
    fused_projections = ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a")  # one matmul at inference

    def __init__(self, config: Qwen35Config):
        super().__init__()
        c = config
        self.num_k_heads, self.num_v_heads = c.linear_num_key_heads, c.linear_num_value_heads
        self.head_k_dim, self.head_v_dim = c.linear_key_head_dim, c.linear_value_head_dim
        self.key_dim = self.num_k_heads * self.head_k_dim
        self.value_dim = self.num_v_heads * self.head_v_dim
        self.conv_dim = 2 * self.key_dim + self.value_dim
        self.kernel = c.linear_conv_kernel_dim
        self.input_projections(c.hidden_size)
        self.conv1d = nn.Conv1d(self.conv_dim, self.conv_dim, self.kernel, groups=self.conv_dim,
                                padding=self.kernel - 1, bias=False)
        self.dt_bias = nn.Parameter(torch.ones(self.num_v_heads))
        a = torch.empty(self.num_v_heads)  # on the meta device (a checkpoint's model) no values: log() there imports
        self.A_log = nn.Parameter(a if a.is_meta else a.uniform_(0.01, 16).log())  # torch._dynamo (budget.MetaFills)
        self.norm = RMSNormGated(self.head_v_dim, c.rms_norm_eps)
        self.out_proj = nn.Linear(self.value_dim, c.hidden_size, bias=False)

    def forward(self, x: torch.Tensor, pos: Positions, cache: DeltaState | None = None
                ) -> tuple[torch.Tensor, DeltaSteps | None]:
        """x [B, T, H] -> ([B, T, H], None); with a cache (a prefill), continue from its state and update it in place.
        A decode forward (`pos.decoding`) leaves the cache as it is and returns `DeltaSteps` for `DeltaState.keep_at`
        (or, for a step every row keeps, `pos.commit`, may update it in place and return None)."""
        if pos.decoding:
            return self.decode(x, cache, pos.commit)
        B, T, _ = x.shape
        qkv, z, b, a = self.projections(x)
        # a bf16 prompt's chunk on the CPU: T plain steps in one C call, 1.3x faster prefills on the shipped model, 2.5x
        # for short prompts (the chunked form is ~150 tensor ops per chunk). In fp32 the chunked form stays: it
        # matches transformers to 1e-4, the recurrence (like every decode step) to ~1e-3 at a worst position; in bf16
        # the rounding of every activation is larger than either (docs/decisions.md, 2026-12-03, prefill).
        if (cache is not None and z.dtype == cache.conv.dtype == torch.bfloat16 and not torch.compiler.is_compiling()
                and deltanet_kernel.usable(z, cache.ssm) and cache.contiguous()):
            window = torch.cat([cache.conv, qkv.transpose(1, 2)], dim=-1)  # [B, C, kernel-1+T]
            return self._step_in_place(window, z, b, a, cache), None
        qkv = qkv.transpose(1, 2)  # [B, C, T]
        if cache is None:
            qkv = self._conv(qkv, self.kernel - 1)[..., :T]
        else:
            window = torch.cat([cache.conv, qkv.to(cache.conv.dtype)], dim=-1)  # [B, C, kernel-1+T]
            qkv = self._short_conv(window, T) if T <= 16 else self._conv(window, 0)
            cache.conv.copy_(window[..., -(self.kernel - 1):])
        q, k, v, g, beta = self._heads(qkv, b, a)

        if cache is not None and T == 1:
            o, S, _ = recurrent_gated_delta_rule(q, k, v, g, beta, cache.ssm)
        else:
            o, S = chunk_gated_delta_rule(q, k, v, g, beta, None if cache is None else cache.ssm)
        if cache is not None:
            cache.ssm.copy_(S)
        return self._out(o, z, x.dtype), None

    def decode(self, x: torch.Tensor, cache: DeltaState, commit: bool = False) -> tuple[torch.Tensor, DeltaSteps | None]:
        """A decode forward of T tokens per row continuing from `cache` (static shapes): ([B, T, H], the conv window
        and each token's update of the state, or the state after every token: `DeltaSteps`). The cache is not
        changed: `DeltaState.keep_at` selects. `commit` (one token that every row keeps, `Positions.commit`): where the
        C step runs eagerly, the cache is updated in place and the steps are None."""
        T = x.shape[1]
        qkv, z, b, a = self.projections(x)
        window = torch.cat([cache.conv, qkv.transpose(1, 2).to(cache.conv.dtype)], dim=-1)  # [B, C, kernel-1+T]
        if z.dtype == window.dtype and deltanet_kernel.usable(window, z, cache.ssm):  # one C call for all of it
            if commit and not torch.compiler.is_compiling() and cache.contiguous():
                return self._step_in_place(window, z, b, a, cache), None
            out, updates = deltanet_kernel.decode_step(*self._kernel_args(window, z, b, a, cache), self.num_k_heads)
            return self.out_proj(out), DeltaSteps(window, updates=updates)
        q, k, v, g, beta = self._heads(self._short_conv(window, T), b, a)
        o, _, states = recurrent_gated_delta_rule(q, k, v, g, beta, cache.ssm, keep_states=True)
        return self._out(o, z, x.dtype), DeltaSteps(window, states=states)

    def _kernel_args(self, window: torch.Tensor, z: torch.Tensor, b: torch.Tensor, a: torch.Tensor,
                     cache: DeltaState) -> tuple:
        return (window, self.conv1d.weight[:, 0, :], b, a, self.A_log, self.dt_bias, z, self.norm.weight, self.norm.eps,
                cache.ssm)

    def _step_in_place(self, window: torch.Tensor, z: torch.Tensor, b: torch.Tensor, a: torch.Tensor,
                       cache: DeltaState) -> torch.Tensor:
        """The T tokens of window [B, C, kernel-1+T] kept by every row: the cache advances in place -> [B, T, H]."""
        args = self._kernel_args(window, z, b, a, cache)
        return self.out_proj(deltanet_kernel.step_in_place(*args, cache.conv, self.num_k_heads))

    def input_projections(self, hidden: int) -> None:
        """The input projections, under the checkpoint's names (Qwen3-Next fuses them differently)."""
        self.in_proj_qkv = nn.Linear(hidden, self.conv_dim, bias=False)
        self.in_proj_z = nn.Linear(hidden, self.value_dim, bias=False)
        self.in_proj_b = nn.Linear(hidden, self.num_v_heads, bias=False)
        self.in_proj_a = nn.Linear(hidden, self.num_v_heads, bias=False)

    def projections(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """x [B, T, H] -> the conv inputs qkv [B, T, C] (all q heads, all k heads, all v heads), the gate z
        [B, T, value_dim], b and a [B, T, Hv]."""
        return project(self, x, "in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a")

    def _conv(self, x: torch.Tensor, padding: int) -> torch.Tensor:
        """The depthwise conv of x [B, C, L] (a prefill's or a training forward's) -> [B, C, L + 2 padding - kernel + 1].
        Without grad, on a CPU without oneDNN's bf16 kernels (AVX2-only), a bf16 input is convolved in fp32 and
        rounded back once: torch's bf16 depthwise conv there runs a per-channel slow path (13x the fp32 one at 1152
        channels x 384 tokens on an AVX2 EPYC, half of a prefill; the same bf16 outputs, docs/decisions.md,
        2026-12-03). Elsewhere oneDNN runs it, as before."""
        weight = self.conv1d.weight  # [C, 1, kernel]
        if (x.dtype == torch.bfloat16 and x.device.type == "cpu" and not torch.is_grad_enabled()
                and not packed_bf16_supported()):
            return F.conv1d(x.float(), weight.float(), padding=padding, groups=self.conv_dim).to(x.dtype)
        return F.conv1d(x, weight, padding=padding, groups=self.conv_dim)

    def _short_conv(self, window: torch.Tensor, T: int) -> torch.Tensor:
        """The causal depthwise conv of the last T inputs of window [B, C, kernel-1+T] -> [B, C, T]: the taps summed
        left to right. mkldnn's conv1d costs ~4-10x more on such short windows, and this order is the same for every
        T, so a plain step (T=1) and a verify block (T=k+1) give bit-identical conv outputs (docs/decisions.md,
        2026-11-29 bench)."""
        taps = self.conv1d.weight[:, 0, :]  # [C, kernel]
        out = window[..., 0:T] * taps[:, 0:1]
        for j in range(1, self.kernel):
            out = out + window[..., j : j + T] * taps[:, j : j + 1]
        return out

    def _heads(self, qkv: torch.Tensor, b: torch.Tensor, a: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Conv outputs [B, C, T] and the b/a projections [B, T, Hv] -> q, k [B, Hv, T, Kd] (normalised, q scaled),
        v [B, Hv, T, Vd], the log decay g and beta [B, Hv, T]; all fp32."""
        B, _, T = qkv.shape
        # contiguous [B, T, C]: the l2norm reductions below then run over a contiguous last dim for every T, so a
        # verified position sums exactly as a plain step does (a stride-T dim sums in another order)
        qkv = rowwise(F.silu, qkv.transpose(1, 2).contiguous())
        q, k, v = qkv.split([self.key_dim, self.key_dim, self.value_dim], dim=-1)
        q = q.reshape(B, T, self.num_k_heads, self.head_k_dim)
        k = k.reshape(B, T, self.num_k_heads, self.head_k_dim)
        v = v.reshape(B, T, self.num_v_heads, self.head_v_dim)
        rep = self.num_v_heads // self.num_k_heads
        if rep > 1:  # each q/k head serves `rep` consecutive value heads
            q, k = q.repeat_interleave(rep, dim=2), k.repeat_interleave(rep, dim=2)
        q, k, v = (t.transpose(1, 2).float() for t in (q, k, v))  # [B, Hv, T, d] fp32
        q = l2norm(q) * (self.head_k_dim**-0.5)
        k = l2norm(k)
        # per head: a few elements per position, so computed `rowwise` (the same bits for any number of positions)
        beta = rowwise(torch.sigmoid, b.float()).transpose(1, 2)  # [B, Hv, T]
        g = (-self.A_log.float().exp() * rowwise(F.softplus, a.float() + self.dt_bias.float())).transpose(1, 2)
        return q, k, v, g, beta

    def _out(self, o: torch.Tensor, z: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """o [B, Hv, T, Vd] (fp32) and the gate z [B, T, value_dim] -> [B, T, H]."""
        B, _, T, _ = o.shape
        o = o.transpose(1, 2).to(dtype)  # [B, T, Hv, Vd]
        z = z.reshape(B, T, self.num_v_heads, self.head_v_dim)
        return self.out_proj(self.norm(o, z).reshape(B, T, self.value_dim))

    def new_state(self, batch: int, max_len: int, dtype: torch.dtype, device: torch.device | str) -> DeltaState:
        """Zero decode state: conv inputs [B, C, kernel-1] in the model dtype, recurrent state fp32."""
        return DeltaState(torch.zeros(batch, self.conv_dim, self.kernel - 1, dtype=dtype, device=device),
                          torch.zeros(batch, self.num_v_heads, self.head_k_dim, self.head_v_dim, dtype=torch.float32,
                                      device=device))
