"""Training a mask-token adapter (`model/masks.py`) onto a frozen model: `mtp retrofit --style masks`.

One step, for a batch of windows ids [B, T] of the corpus:
  1. the frozen backbone reads each window in chunks up to C cut points c_1 < c_2 < ... (no gradient), its cache
     left at the cut, and gives the teacher: its own distribution and hidden state at every position;
  2. at each cut c, the k mask tokens go in at positions c+1..c+k as ONE decode forward over that cache (recurrent
     states are not advanced by it, and the next chunk overwrites the masks' attention entries), with gradients into
     the adapter only: mask i's hidden state z_i must predict token c+i+1, as the backbone does at position c+i;
  3. the loss of the block (our reading of the paper's objective, docs/decisions.md):
        KL(teacher_{c+i} || head(sampler(z_i, embed(x_{c+i}))))      the sampler head's draft (teacher forcing)
      + KL(teacher_{c+i} || head(z_i))                               the mask's own prediction
      + lcm_weight * mean((z_i - h_{c+i})^2)                          latent consistency with the backbone's state
     backpropagated at once (the cache it read is overwritten by the next chunk).
The gate keeps every ordinary token's computation the backbone's, so nothing but the adapter receives a gradient.
Exact resume: the adapter, AdamW's state, the RNG and the step (which fixes the data) are checkpointed atomically.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from ..io.files import FolderWriter, atomic_write_text, fsync_folder
from ..model.masks import MASKS_CONFIG, MaskAdapter, MasksConfig, load_adapter
from .loss import self_distill_loss
from .state import rng_state, set_rng_state

STATE = "masks_state.pt"


@dataclass
class MasksTrainConfig:
    masks: int = 3
    rank: int = 16
    alpha: float = 16.0
    steps: int = 400
    lr: float = 1e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 10
    seq_len: int = 256
    micro_batch: int = 8
    cuts: int = 12  # mask blocks per window
    lcm_weight: float = 1.0
    eval_seqs: int = 64
    eval_every: int = 100
    seed: int = 0
    max_minutes: float | None = None


def lr_at(step: int, c: MasksTrainConfig) -> float:
    if step < c.warmup_steps:
        return c.lr * (step + 1) / c.warmup_steps
    t = min(1.0, (step - c.warmup_steps) / max(1, c.steps - c.warmup_steps))
    return c.lr * (c.min_lr_ratio + (1 - c.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * t)))


def cut_points(T: int, k: int, cuts: int, gen: torch.Generator) -> list[int]:
    """`cuts` sorted positions c in [8, T-k-1] (each needs targets up to c+k+1 < T), random per step."""
    hi = T - k - 1
    lo = min(8, hi)
    n = min(cuts, hi - lo + 1)
    return sorted(torch.randperm(hi - lo + 1, generator=gen)[:n].add(lo).tolist())


def block_losses(model, adapter: MaskAdapter, ids: torch.Tensor, cuts: list[int], lcm_weight: float,
                 train: bool) -> dict:
    """Steps 1-3 of the module docstring over ids [B, T] (backward per block when `train`). Returns sums for the
    metrics: loss, and per draft position the chained matches (`hit_i` / `tried_i`)."""
    B, T = ids.shape
    k = adapter.config.masks
    dev = ids.device
    cache = model.new_cache(B, T + k + 8)
    mask_ids = torch.tensor(adapter.config.mask_ids, device=dev)[None].expand(B, k)
    out = {"loss": 0.0, "blocks": 0, **{f"hit_{i}": 0 for i in range(1, k + 1)}, **{f"tried_{i}": 0 for i in range(1, k + 1)}}
    hidden, read = [], 0
    with torch.no_grad():
        h_all = model.hidden(ids)  # the teacher over the whole window (no cache)
        teacher = model.head(h_all)  # [B, T, V]
        greedy = teacher.argmax(-1)
    for c in cuts:
        with torch.no_grad():
            if c + 1 > read:
                hidden.append(model.hidden(ids[:, read : c + 1], cache))
                read = c + 1
        pos = model.decode_positions(torch.arange(c + 1, c + 1 + k, device=dev)[None].expand(B, k), [c + 1] * B)
        with torch.enable_grad() if train else torch.no_grad():
            z, _ = model.decode(mask_ids, cache, pos)  # [B, k, H]
            t = teacher[:, c + 1 : c + 1 + k]
            samp = adapter.draft_logits(model, z, ids[:, c + 1], ids[:, c + 2 : c + 1 + k])
            loss = self_distill_loss(samp, t) + self_distill_loss(model.head(z), t)
            if lcm_weight:
                loss = loss + lcm_weight * F.mse_loss(z.float(), h_all[:, c + 1 : c + 1 + k].float())
        if train:
            loss.backward()
            for layer in cache.layers:  # the block's graph is freed: the cache holds plain tensors again
                for v in vars(layer).values():
                    if isinstance(v, torch.Tensor):
                        v.detach_()
        match = samp.detach().argmax(-1) == greedy[:, c + 1 : c + 1 + k]  # [B, k]
        chain = torch.ones(B, dtype=torch.bool, device=dev)
        for i in range(k):
            out[f"tried_{i + 1}"] += int(chain.sum())
            chain = chain & match[:, i]
            out[f"hit_{i + 1}"] += int(chain.sum())
        out["loss"] += float(loss.detach())
        out["blocks"] += 1
    return out


def summarize(sums: dict, k: int) -> dict:
    """Sums of `block_losses` -> loss, acceptance per draft position, expected tokens per forward (bonus included)."""
    acc = [sums[f"hit_{i}"] / sums[f"tried_{i}"] if sums[f"tried_{i}"] else 0.0 for i in range(1, k + 1)]
    length, p = 1.0, 1.0
    for a in acc:
        p *= a
        length += p
    return {"loss": sums["loss"] / max(1, sums["blocks"]), "acceptance_per_position": acc, "mean_accepted_length": length}


@torch.no_grad()
def evaluate_masks(model, adapter: MaskAdapter, batches: list[torch.Tensor], cuts: int, lcm_weight: float) -> dict:
    """Held-out metrics on fixed windows (fixed cut points): what `block_losses` measures, without gradients."""
    k = adapter.config.masks
    gen = torch.Generator().manual_seed(1234)
    total: dict = {}
    for ids in batches:
        ids = ids.to(model.device)
        r = block_losses(model, adapter, ids, cut_points(ids.shape[1], k, cuts, gen), lcm_weight, train=False)
        for key, v in r.items():
            total[key] = total.get(key, 0) + v
    return summarize(total, k)


def save_run(out: Path, step: int, adapter: MaskAdapter, optimizer, cfg: MasksTrainConfig) -> None:
    """out/checkpoints/step-N (adapter + optimizer + RNG + step), written whole then renamed; out/latest names it."""
    root = out / "checkpoints"
    root.mkdir(parents=True, exist_ok=True)
    final, tmp = root / f"step-{step:06d}", root / f".step-{step:06d}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        with FolderWriter(tmp, replace_weights=False) as w:
            adapter.write(w)
            state = {"step": step, "optimizer": optimizer.state_dict(), "rng": rng_state(), "config": asdict(cfg)}
            w.write(STATE, lambda f: torch.save(state, f))
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        fsync_folder(root)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    atomic_write_text(out / "latest", final.name + "\n")
    for old in sorted(p for p in root.glob("step-*") if p.is_dir())[:-1]:
        shutil.rmtree(old, ignore_errors=True)


def train_masks(model, data: str | Path, out: str | Path, cfg: MasksTrainConfig, progress: bool = True) -> MaskAdapter:
    """Train (or resume, from out/latest) a mask adapter onto the frozen `model`; returns it attached to the model.
    Logs out/metrics.jsonl (train rows and held-out rows)."""
    from tqdm import tqdm

    from ..data.shards import TokenShards
    from .batches import Batches

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(cfg.seed)
    for p in model.parameters():
        p.requires_grad_(False)
    latest = out / "latest"
    if latest.exists():  # exact resume: the adapter, the optimizer, the RNG, the step
        ckpt = out / "checkpoints" / latest.read_text().strip()
        adapter = load_adapter(model, ckpt)
        st = torch.load(ckpt / STATE, weights_only=False, map_location=model.device)
    else:
        adapter = MaskAdapter.attach(model, MasksConfig(cfg.masks, cfg.rank, cfg.alpha, model.config.vocab_size))
        st = None
    params = list(adapter.parameters())
    opt = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=0.0)
    step = 0
    if st is not None:
        opt.load_state_dict(st["optimizer"])
        set_rng_state(st["rng"])
        step = st["step"]
    batches = Batches(TokenShards(data, "train"), cfg.seq_len, cfg.seed)
    val = Batches(TokenShards(data, "val"), cfg.seq_len, cfg.seed).fixed(cfg.eval_seqs, cfg.micro_batch)
    metrics = out / "metrics.jsonl"
    rows = [r for r in map(json.loads, metrics.read_text().splitlines()) if r["step"] <= step] if metrics.exists() else []
    metrics.write_text("".join(json.dumps(r) + "\n" for r in rows))
    last_val = next((r for r in reversed(rows) if r.get("split") == "val"), None)
    bar = tqdm(total=cfg.steps, initial=step, disable=not progress, unit="step", dynamic_ncols=True, mininterval=2.0)
    model.train(False)
    t_start = time.perf_counter()
    while step < cfg.steps:
        t0 = time.perf_counter()
        gen = torch.Generator().manual_seed(cfg.seed * 1_000_003 + step)  # the step fixes the cuts (exact resume)
        ids = batches.micro_batch(step, 0, cfg.micro_batch, 1, 0, 1).to(model.device)
        for g in opt.param_groups:
            g["lr"] = lr_at(step, cfg)
        r = block_losses(model, adapter, ids, cut_points(ids.shape[1], cfg.masks, cfg.cuts, gen), cfg.lcm_weight, True)
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        step += 1
        s = summarize(r, cfg.masks)
        tok_s = ids.numel() / (time.perf_counter() - t0)
        row = {"split": "train", "step": step, "loss": s["loss"], "accept": s["acceptance_per_position"], "tok_s": tok_s}
        with open(metrics, "a") as f:
            f.write(json.dumps(row) + "\n")
        bar.update(1)
        shown = "" if last_val is None else " | val accept " + " ".join(f"{a:.2f}" for a in last_val["acceptance_per_position"])
        bar.set_postfix_str(f"L {s['loss']:.3f} accept " + " ".join(f"{a:.2f}" for a in s["acceptance_per_position"])
                            + f" {tok_s:,.0f} tok/s" + shown)
        late = cfg.max_minutes is not None and (time.perf_counter() - t_start) / 60 > cfg.max_minutes
        if step % cfg.eval_every == 0 or step == cfg.steps or late:
            last_val = {"split": "val", "step": step, **evaluate_masks(model, adapter, val, cfg.cuts, cfg.lcm_weight)}
            with open(metrics, "a") as f:
                f.write(json.dumps(last_val) + "\n")
            bar.write(f"step {step}: val loss {last_val['loss']:.4f} accept "
                      + " ".join(f"{a:.3f}" for a in last_val["acceptance_per_position"]))
            save_run(out, step, adapter, opt, cfg)
        if late:
            bar.write(f"mtp retrofit: stopped after {cfg.max_minutes} minutes at step {step}/{cfg.steps}")
            break
    bar.close()
    return adapter


__all__ = ["MASKS_CONFIG", "MasksTrainConfig", "evaluate_masks", "train_masks"]
