"""Mixture-of-Experts building blocks: routed SwiGLU experts that compute only the experts tokens chose, the
Qwen3.5-MoE sparse block (softmax router + gated shared expert), DeepSeekMoE (grouped sigmoid router with a
selection bias + shared experts; DeepSeek-V3 and GLM-4.5), the load-balancing loss, and the two expert layouts
checkpoints use.

Experts are stored fused, as transformers holds them: `experts.gate_up_proj [E, 2I, H]` (gate rows first) and
`experts.down_proj [E, H, I]`. Checkpoints hold them either that way ("fused") or one tensor per expert
("per_expert": `experts.{e}.gate_proj.weight [I, H]`, `up_proj [I, H]`, `down_proj [H, I]`); `group_experts`
maps either onto the fused parameters and `split_experts` writes them back in the layout they were read in.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ..io.safetensors_mmap import CheckpointError
from .layer import MLP
from .linear import FastLinear, LayerSource, linear_rows, quantized_kernel
from .rowwise import rowwise


class Experts(nn.Module):
    """E routed SwiGLU experts: x [N, H], chosen experts idx [N, k] and their weights [N, k] -> [N, H].

    Only the chosen experts run: the N*k choices are sorted by expert and each chosen expert multiplies the rows
    of every token that chose it at once (a verify of q tokens reads each of its experts' weights once). No
    [E, ...] tensor is built per step."""

    def __init__(self, num_experts: int, hidden: int, intermediate: int):
        super().__init__()
        self.num_experts, self.intermediate = num_experts, intermediate
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * intermediate, hidden))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden, intermediate))

    def forward(self, x: torch.Tensor, idx: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        N, k = idx.shape
        out = torch.zeros_like(x)
        if N == 1:  # decoding one token: its k experts, added in expert order and rounded as the grouped path adds them
            for e, j in sorted(zip(idx[0].tolist(), range(k))):
                out += (self._expert(e, x) * weights[:, j : j + 1]).to(out.dtype)
            return out
        flat = idx.reshape(-1)
        order = flat.argsort(stable=True)
        experts, counts = torch.unique_consecutive(flat[order], return_counts=True)
        w = weights.reshape(-1, 1)
        start = 0
        for e, c in zip(experts.tolist(), counts.tolist()):
            slots = order[start : start + c]
            tokens = slots // k
            y = self._expert(e, x[tokens]) * w[slots]
            out.index_add_(0, tokens, y.to(out.dtype))
            start += c
        return out

    def _expert(self, e: int, x: torch.Tensor) -> torch.Tensor:
        kernels = self.__dict__.get("_kernels")
        if kernels is not None:  # quantized: expert e's prepared layers (`prepare`)
            gate_up, down = kernels[e]
            gate, up = gate_up(x).chunk(2, dim=-1)
            return down(rowwise(F.silu, gate) * up)
        gate, up = linear_rows(x, self.gate_up_proj[e]).chunk(2, dim=-1)
        return linear_rows(rowwise(F.silu, gate) * up, self.down_proj[e])

    def prepare(self, kernel: str, weights: Callable[[int], tuple[torch.Tensor, torch.Tensor]] | None = None) -> None:
        """Quantize each expert for inference (`linear.FastLinear`, kernel "int8" or "int4"), as the model's linear
        layers are: expert e then runs two prepared layers over views of its slices of the parameters (int8 where
        the int4 kernel cannot run the shape), which are unchanged (used again, through `linear_rows`, while training).
        `weights(e)`: expert e's (gate_up [2I, H], down [H, I]) to quantize instead of the parameters' slices (a load
        whose parameters are meta: each expert decoded only as it is quantized; valid until the next call)."""
        def layer(w: torch.Tensor, given: torch.Tensor | None) -> FastLinear:
            lin = nn.Linear(w.shape[1], w.shape[0], bias=False, device="meta")
            lin.weight = nn.Parameter(w, requires_grad=False)
            source = None if given is None else LayerSource(weight=lambda: given)
            return FastLinear.wrap(lin, quantized_kernel(kernel, lin), source=source)  # as the linears do

        kernels = []
        for e in range(self.num_experts):
            gate_up, down = (None, None) if weights is None else weights(e)
            kernels.append((layer(self.gate_up_proj[e], gate_up), layer(self.down_proj[e], down)))
        self.__dict__["_kernels"] = kernels

    def release(self) -> None:
        """Inference only, after `prepare`: let go of the float expert weights (the parameters become meta tensors of
        the same shapes; each expert's prepared layers hold only their codes, `FastLinear.release`)."""
        if "_kernels" not in self.__dict__:
            raise ValueError("Experts.release needs prepared experts (call prepare first)")
        for gate_up, down in self._kernels:
            gate_up.release()
            down.release()
        for name in ("gate_up_proj", "down_proj"):
            p = getattr(self, name)
            setattr(self, name, nn.Parameter(torch.empty(p.shape, dtype=p.dtype, device="meta"), requires_grad=False))


class SparseMoE(nn.Module):
    """The Qwen3.5-MoE block (`mlp`): router `gate` [E, H] -> softmax (fp32) -> top-k -> weights renormalised to sum 1
    (Qwen3.5-MoE always; Qwen3-Next when `norm_topk_prob`); the routed experts; plus `shared_expert` (SwiGLU) times
    sigmoid(`shared_expert_gate`(x)).

    x [B, T, H] -> (out [B, T, H], router logits [B*T, E]) - the logits feed the load-balancing loss."""

    def __init__(self, hidden: int, num_experts: int, top_k: int, intermediate: int, shared_intermediate: int,
                 norm_topk_prob: bool = True):
        super().__init__()
        self.top_k, self.norm_topk_prob = top_k, norm_topk_prob
        self.gate = nn.Linear(hidden, num_experts, bias=False)
        self.experts = Experts(num_experts, hidden, intermediate)
        self.shared_expert = MLP(hidden, shared_intermediate)
        self.shared_expert_gate = nn.Linear(hidden, 1, bias=False)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [N, H] -> router logits [N, E], chosen experts [N, k], their weights [N, k] (x's dtype)."""
        logits = self.gate(x)  # a prepared linear: row-invariant, the choice of experts must not depend on the batch
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        weights, idx = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return logits, idx, weights.to(logits.dtype)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        B, T, H = x.shape
        flat = x.reshape(-1, H)
        logits, idx, weights = self.route(flat)
        routed = self.experts(flat, idx, weights)
        shared = rowwise(torch.sigmoid, self.shared_expert_gate(flat)) * self.shared_expert(flat)
        return (routed + shared).reshape(B, T, H), logits


class GroupedTopkRouter(nn.Module):
    """DeepSeek-V3's router (`mlp.gate`; docs/families.md, "Router"): `weight` [E, H] and `e_score_correction_bias`
    [E], both kept in fp32. Scores s = sigmoid(x W^T) in fp32; the biased scores s + b choose (the bias never
    weights): the `topk_group` groups (of E / n_group experts) with the largest sums of their top-2 biased scores,
    then the top-k experts inside them. Weights = s at the chosen experts, divided by their sum (+1e-20) when
    `norm_topk_prob`, times `routed_scaling_factor`.

    x [N, H] -> chosen experts [N, k], their weights [N, k] (fp32)."""

    def __init__(self, hidden: int, num_experts: int, top_k: int, n_group: int, topk_group: int, norm_topk_prob: bool,
                 routed_scaling_factor: float):
        super().__init__()
        self.num_experts, self.top_k, self.n_group, self.topk_group = num_experts, top_k, n_group, topk_group
        self.norm_topk_prob, self.routed_scaling_factor = norm_topk_prob, routed_scaling_factor
        self.weight = nn.Parameter(torch.empty(num_experts, hidden, dtype=torch.float32))
        # Updated outside the gradient by DeepSeek's auxiliary-loss-free balancing (which `mtp` does not train): a buffer.
        self.register_buffer("e_score_correction_bias", torch.zeros(num_experts, dtype=torch.float32))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        scores = rowwise(torch.sigmoid, linear_rows(x.float(), self.weight.float()))
        choice = scores + self.e_score_correction_bias.float()
        if self.n_group > 1:
            groups = choice.view(-1, self.n_group, self.num_experts // self.n_group)
            group_scores = groups.topk(2, dim=-1)[0].sum(dim=-1)  # [N, n_group]
            keep = torch.zeros_like(group_scores, dtype=torch.bool)
            keep.scatter_(1, group_scores.topk(self.topk_group, dim=-1, sorted=False)[1], True)
            choice = choice.masked_fill(~keep.repeat_interleave(self.num_experts // self.n_group, dim=1), float("-inf"))
        idx = choice.topk(self.top_k, dim=-1, sorted=False)[1]
        weights = scores.gather(1, idx)
        if self.norm_topk_prob:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return idx, weights * self.routed_scaling_factor


class DeepseekMoE(nn.Module):
    """DeepSeekMoE (`mlp`): `gate` (GroupedTopkRouter), the routed `experts`, plus `shared_experts` (one SwiGLU of
    width moe_intermediate_size x n_shared_experts, ungated) when n_shared_experts > 0. x [B, T, H] -> [B, T, H].

    No load-balancing loss: DeepSeek-V3 balances without one (its bias), and transformers computes none."""

    def __init__(self, hidden: int, num_experts: int, top_k: int, intermediate: int, n_shared_experts: int, n_group: int,
                 topk_group: int, norm_topk_prob: bool, routed_scaling_factor: float):
        super().__init__()
        self.gate = GroupedTopkRouter(hidden, num_experts, top_k, n_group, topk_group, norm_topk_prob,
                                      routed_scaling_factor)
        self.experts = Experts(num_experts, hidden, intermediate)
        if n_shared_experts:
            self.shared_experts = MLP(hidden, intermediate * n_shared_experts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, H = x.shape
        flat = x.reshape(-1, H)
        idx, weights = self.gate(flat)
        out = self.experts(flat, idx, weights)
        if hasattr(self, "shared_experts"):
            out = out + self.shared_experts(flat)
        return out.reshape(B, T, H)


def load_balancing_loss(router_logits: list[torch.Tensor], num_experts: int, top_k: int) -> torch.Tensor:
    """Switch-Transformer auxiliary loss over layers' router logits (each [N, E]), as transformers computes it:
    E * sum_e (fraction of top-k choices on e) * (mean router probability of e), pooled over the layers."""
    tokens = torch.zeros(num_experts, dtype=torch.float32, device=router_logits[0].device)
    probs = torch.zeros_like(tokens)
    rows = 0
    for logits in router_logits:
        p = torch.softmax(logits.float(), dim=-1)
        chosen = torch.topk(p, top_k, dim=-1).indices
        tokens = tokens + torch.zeros_like(tokens).index_add_(0, chosen.reshape(-1), torch.ones(chosen.numel(), device=tokens.device))
        probs = probs + p.sum(dim=0)
        rows += p.shape[0]
    return torch.sum((tokens / rows) * (probs / rows)) * num_experts


# ---------------------------------------------------------------------- checkpoint layouts
PER_EXPERT = re.compile(r"^(?P<prefix>.*\.experts)\.(?P<e>\d+)\.(?P<proj>gate_proj|up_proj|down_proj)\.weight$")
FUSED = re.compile(r"^(?P<prefix>.*\.experts)\.(?P<proj>gate_up_proj|down_proj)$")


@dataclass(frozen=True)
class Stack:
    """An internal [E, ...] tensor built from per-expert checkpoint tensors: expert e is the concatenation (along
    dim 0) of the tensors named parts[e]."""

    parts: tuple[tuple[str, ...], ...]


def group_experts(sources: dict[str, str], shape, num_experts: int, intermediate: int,
                  intermediate_key: str = "moe_intermediate_size",
                  experts_key: str = "num_experts") -> tuple[dict[str, str | Stack], dict[str, str]]:
    """Map per-expert checkpoint tensors onto the fused parameters.

    sources: our name -> checkpoint name (per-expert tensors under their own per-expert names); shape(name) gives a
    checkpoint tensor's shape. Returns the sources with per-expert entries replaced by `Stack`s, and the layout of
    each experts module ({our prefix: "fused" | "per_expert"}). Errors name the tensor and the config key: a
    layer mixing layouts, a missing expert, an expert count or width that disagrees with the config."""
    out: dict[str, str | Stack] = {}
    per: dict[str, dict[str, dict[int, str]]] = {}
    layouts: dict[str, str] = {}
    for ours, ckpt in sources.items():
        m = PER_EXPERT.match(ours)
        if m is None:
            f = FUSED.match(ours)
            if f is not None:
                layouts.setdefault(f["prefix"], "fused")
                if layouts[f["prefix"]] != "fused":
                    raise CheckpointError(f"tensor '{ckpt}': layer {f['prefix']} mixes fused and per-expert tensors")
                n = shape(ckpt)[0]
                if n != num_experts:
                    raise CheckpointError(f"tensor '{ckpt}' holds {n} experts but config key '{experts_key}' is {num_experts}")
            out[ours] = ckpt
            continue
        prefix, e = m["prefix"], int(m["e"])
        if layouts.setdefault(prefix, "per_expert") != "per_expert":
            raise CheckpointError(f"tensor '{ckpt}': layer {prefix} mixes fused and per-expert tensors")
        per.setdefault(prefix, {}).setdefault(m["proj"], {})[e] = ckpt
    for prefix, projs in per.items():
        for proj in ("gate_proj", "up_proj", "down_proj"):
            have = projs.get(proj, {})
            beyond = sorted(e for e in have if e >= num_experts)
            if beyond:
                raise CheckpointError(f"tensor '{have[beyond[0]]}': expert {beyond[0]} but config key '{experts_key}' "
                                      f"is {num_experts}")
            missing = [e for e in range(num_experts) if e not in have]
            if missing:
                name = f"{prefix}.{missing[0]}.{proj}.weight"
                more = f" (and {len(missing) - 1} more experts)" if len(missing) > 1 else ""
                raise CheckpointError(f"missing tensor '{name}'{more}")
            for ckpt in have.values():
                width = shape(ckpt)[0 if proj != "down_proj" else 1]
                if width != intermediate:
                    raise CheckpointError(f"tensor '{ckpt}' has shape {list(shape(ckpt))}: its expert width {width} "
                                          f"disagrees with config key '{intermediate_key}' ({intermediate})")
        out[f"{prefix}.gate_up_proj"] = Stack(tuple((projs["gate_proj"][e], projs["up_proj"][e]) for e in range(num_experts)))
        out[f"{prefix}.down_proj"] = Stack(tuple((projs["down_proj"][e],) for e in range(num_experts)))
    return out, layouts


def split_experts(state: dict[str, torch.Tensor], layouts: dict[str, str]) -> dict[str, torch.Tensor]:
    """Our fused expert tensors -> the checkpoint's layout (per expert unless `layouts` says the prefix was read
    fused); other tensors pass through. Names stay ours (the family renames after)."""
    out: dict[str, torch.Tensor] = {}
    for name, t in state.items():
        m = FUSED.match(name)
        if m is None or layouts.get(m["prefix"], "per_expert") == "fused":
            out[name] = t
            continue
        prefix = m["prefix"]
        for e in range(t.shape[0]):
            if m["proj"] == "gate_up_proj":
                gate, up = t[e].chunk(2, dim=0)
                out[f"{prefix}.{e}.gate_proj.weight"] = gate
                out[f"{prefix}.{e}.up_proj.weight"] = up
            else:
                out[f"{prefix}.{e}.down_proj.weight"] = t[e]
    return out
