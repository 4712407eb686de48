"""`mtp retrofit`: multi-token prediction for a model that was trained without it, on a frozen backbone.

Two styles (docs/decisions.md, "MTP for any model"):
- `head`: a fresh DeepSeek/Qwen-style MTP module (the family's own: Qwen3.5's `mtp.*`, DeepSeek/GLM's next-n layers,
  or `hf_causal`'s for any transformers causal LM) trained by self-distillation - the teacher is the frozen
  backbone's own next-token distribution, so the head learns to predict what the backbone will say, which is what
  acceptance measures. It is the trainer's heads mode with `mtp_layers` fresh layers (`trainer.build_model`): exact
  resume, the progress bar, metrics.jsonl all come with it. The result is written in the family's native layout.
- `masks`: k mask tokens, gated LoRA and a sampler head (`train/masks.py`, after Apple's "Your LLM Knows the
  Future", 2025).

Both end with the expected acceptance per draft position on the held-out split before (the base's own MTP, when it
has one) and after, in `OUT/report.json`.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch

from ..io.files import atomic_write_text

STYLES = ("head", "masks")
KEEP = ("loss", "mean_accepted_length")


def heldout(data: str | Path, seq_len: int, eval_seqs: int, batch: int = 8) -> list[torch.Tensor]:
    """The fixed held-out windows every figure of a retrofit is measured on (the data folder's validation split:
    whole files the training split never saw)."""
    from ..data.shards import TokenShards
    from .batches import Batches

    return Batches(TokenShards(data, "val"), seq_len).fixed(eval_seqs, batch)


def summary(metrics: dict, depth: int) -> dict:
    """The report's view of `evaluate`'s metrics: loss, acceptance per draft position, mean accepted length."""
    out = {k: round(metrics[k], 4) for k in KEEP if k in metrics and not math.isnan(metrics[k])}
    out["acceptance_per_position"] = [round(metrics[f"accept_pos_{d}"], 4) for d in range(1, depth + 1)
                                      if f"accept_pos_{d}" in metrics]
    return out


def retrofit_head(base: str, data: str, out: Path, layers: int = 1, steps: int = 400, lr: float = 1e-3,
                  seq_len: int = 256, micro_batch: int = 8, eval_seqs: int = 64, eval_every: int = 100,
                  threads: int | None = None, device: str = "auto", seed: int = 0, bf16: bool = False,
                  max_minutes: float | None = None, progress: bool = True) -> dict:
    """Train `layers` fresh MTP layers onto the frozen `base` by self-distillation; the run lives in `out` (resumes
    from out/latest), the model in out/model. Returns the report (also written to out/report.json)."""
    from ..model import load_model
    from .config import TrainConfig
    from .evaluate import evaluate
    from .trainer import train

    if threads:
        torch.set_num_threads(threads)
    out = Path(out)
    val = heldout(data, seq_len, eval_seqs)
    report: dict = {"style": "head", "base": str(base), "layers": layers, "steps": steps}
    base_model = load_model(base, dtype="float32")
    if base_model.mtp is not None:  # the figure to beat: the MTP the model was trained with
        d = base_model.mtp.num_layers
        report["before"] = {"native_mtp": summary(evaluate(base_model, val, d), d)}
    else:
        report["before"] = {"note": "no MTP: plain decoding, 1 token per backbone forward",
                            "loss": round(evaluate(base_model, val, 0)["loss"], 4)}
    del base_model
    cfg = TrainConfig(data=str(data), out=str(out), mode="heads", init=str(base), heads_target="self",
                      mtp_layers=layers, seq_len=seq_len, micro_batch=micro_batch, max_steps=steps, lr=lr,
                      warmup_steps=max(1, steps // 20), eval_every=eval_every, save_every=eval_every,
                      eval_seqs=eval_seqs, seed=seed, progress=progress, keep_checkpoints=1, device=device,
                      threads=threads, bf16=bf16, max_minutes=max_minutes)
    train(cfg)
    model = load_model(out / "model", dtype="float32")
    report["after"] = summary(evaluate(model, val, layers), layers)
    report["model"] = str(out / "model")
    atomic_write_text(out / "report.json", json.dumps(report, indent=1) + "\n")
    return report


def retrofit_masks(base: str, data: str, out: Path, masks: int = 3, rank: int = 16, steps: int = 400, lr: float = 1e-3,
                   seq_len: int = 256, micro_batch: int = 8, eval_seqs: int = 64, eval_every: int = 100,
                   threads: int | None = None, device: str = "auto", seed: int = 0, max_minutes: float | None = None,
                   cuts: int = 12, progress: bool = True) -> dict:
    """Train a mask-token adapter (k masks, gated LoRA of `rank`, sampler head) onto the frozen `base` (any MTP it
    has is dropped); the run lives in `out` (resumes from out/latest), the model in out/model (the base's weights
    unchanged + the adapter). Returns the report (also written to out/report.json)."""
    from ..model import load_model, save_model
    from ..model.device import resolve_device
    from ..model.masks import MaskAdapter, MasksConfig
    from .masks import MasksTrainConfig, evaluate_masks, train_masks

    if threads:
        torch.set_num_threads(threads)
    out = Path(out)
    model = load_model(base, dtype="float32", device=str(resolve_device(device)))
    model.mtp = None  # retrofit: the mask block is the only drafter
    model.config.mtp_num_hidden_layers = 0
    cfg = MasksTrainConfig(masks=masks, rank=rank, steps=steps, lr=lr, seq_len=seq_len, micro_batch=micro_batch,
                           eval_seqs=eval_seqs, eval_every=eval_every, seed=seed, max_minutes=max_minutes, cuts=cuts,
                           warmup_steps=max(1, steps // 20))
    val = heldout(data, seq_len, eval_seqs, micro_batch)
    report: dict = {"style": "masks", "base": str(base), "masks": masks, "rank": rank, "steps": steps}
    fresh = MaskAdapter.attach(model, MasksConfig(masks, rank, cfg.alpha, model.config.vocab_size))
    report["before"] = {"note": "no MTP: plain decoding, 1 token per backbone forward",
                        "untrained_adapter": _rounded(evaluate_masks(model, fresh, val, cfg.cuts, cfg.lcm_weight))}
    fresh.detach_from(model)
    adapter = train_masks(model, data, out, cfg, progress=progress)
    report["after"] = _rounded(evaluate_masks(model, adapter, val, cfg.cuts, cfg.lcm_weight))
    # the base's tensors as stored (a bf16 checkpoint stays bf16, not the fp32 copy trained against), then the
    # adapter's fp32 tensors beside them
    adapter.detach_from(model)
    del model
    stored = load_model(base)
    if stored.__dict__.get("masks") is not None:  # a base that had an adapter: the new one replaces it
        stored.masks.detach_from(stored)
    stored.mtp = None
    stored.config.mtp_num_hidden_layers = 0
    save_model(stored, out / "model")
    adapter.save(out / "model")
    from .state import copy_tokenizer

    copy_tokenizer(base if Path(base).is_dir() else None, out / "model")
    report["model"] = str(out / "model")
    atomic_write_text(out / "report.json", json.dumps(report, indent=1) + "\n")
    return report


def _rounded(m: dict) -> dict:
    return {k: (round(v, 4) if isinstance(v, float) else [round(a, 4) for a in v] if isinstance(v, list) else v)
            for k, v in m.items()}
