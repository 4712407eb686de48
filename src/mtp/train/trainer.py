"""The trainer: pretrain / heads / finetune with the MTP objective, single process or `torchrun` (DDP, gloo).

One optimizer step = `grad_accum` micro-batches per process; the global batch is
micro_batch x grad_accum x world_size sequences of `seq_len` tokens. AdamW, linear warm-up then cosine,
gradient clipping, optional bf16 autocast and activation checkpointing. Exact resume: weights (fp32),
optimizer, RNG and the data position (= the step) are restored from the newest checkpoint.
"""

from __future__ import annotations

import json
import math
import os
import random
import time
from contextlib import nullcontext
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from .. import Qwen35Config, Qwen35ForCausalLM, load_model, save_model
from ..data.shards import TokenShards
from ..model import init_weights_
from ..model.mtp_module import MTPModule
from .batches import Batches
from .config import TrainConfig
from .evaluate import evaluate
from .loss import mtp_objective, mtp_weights
from .state import STATE, copy_tokenizer, latest_checkpoint, save_checkpoint, set_rng_state


class SimulatedCrash(RuntimeError):
    """Raised by the `crash_at_step` test hook in place of a kill."""


class Objective(nn.Module):
    """Wraps the model so DDP (and torch.compile) see one forward: ids [B, T], weights [D] ->
    [1 + 1 + D] = (loss to backpropagate, L_main, L_1..L_D), the last ones detached.

    The MTP weights come in as a tensor so that a compiled objective does not recompile when the
    schedule changes them; autocast is entered inside so a compiled graph captures it."""

    def __init__(self, model: Qwen35ForCausalLM, train_backbone: bool, distill: bool, checkpoint_logits: bool,
                 autocast_dtype: torch.dtype | None = None):
        super().__init__()
        self.model = model
        self.train_backbone, self.distill, self.checkpoint_logits = train_backbone, distill, checkpoint_logits
        self.autocast_dtype = autocast_dtype

    def forward(self, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        ctx = (torch.autocast(ids.device.type, dtype=self.autocast_dtype) if self.autocast_dtype is not None
               else nullcontext())
        with ctx:
            out = mtp_objective(self.model, ids, list(weights.unbind(0)), train_backbone=self.train_backbone,
                                distill=self.distill, checkpoint_logits=self.checkpoint_logits)
        return torch.stack([out.loss.float(), out.main.float(), *[d.float() for d in out.depths]])


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Linear warm-up over warmup_steps, then cosine from lr to lr*min_lr_ratio at max_steps."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    t = (step - cfg.warmup_steps) / max(1, cfg.max_steps - cfg.warmup_steps)
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * min(1.0, t))))


def build_model(cfg: TrainConfig, vocab_size: int, eos_id: int | None) -> Qwen35ForCausalLM:
    """pretrain: a fresh model from cfg.model; heads/finetune: the `init` checkpoint (MTP added if missing)."""
    if cfg.mode == "pretrain":
        mc = dict(cfg.model)
        if mc.get("vocab_size", vocab_size) < vocab_size:
            raise ValueError(f"model vocab_size {mc['vocab_size']} is smaller than the data's {vocab_size}")
        mc.setdefault("vocab_size", vocab_size)
        mc.setdefault("eos_token_id", eos_id)
        model = Qwen35ForCausalLM(Qwen35Config(**mc))
        init_weights_(model, seed=cfg.seed)
        return model
    model = load_model(cfg.init)
    if model.config.vocab_size < vocab_size:
        raise ValueError(f"{cfg.init}: vocab_size {model.config.vocab_size} is smaller than the data's {vocab_size}")
    if model.mtp is None:
        if model.config.mtp_num_hidden_layers < 1:
            raise ValueError(f"{cfg.init}: config has mtp_num_hidden_layers=0; set it to train MTP heads")
        torch.manual_seed(cfg.seed)
        model.mtp = MTPModule(model.config)
        fresh = Qwen35ForCausalLM.__new__(Qwen35ForCausalLM)
        nn.Module.__init__(fresh)
        fresh.mtp, fresh.config = model.mtp, model.config
        init_weights_(fresh, seed=cfg.seed)  # only the new mtp.* modules are touched
    return model


def _param_groups(params: list[tuple[str, nn.Parameter]], weight_decay: float) -> list[dict]:
    decay = [p for n, p in params if p.ndim >= 2]
    no_decay = [p for n, p in params if p.ndim < 2]
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def _plot(out: Path, rows: list[dict]) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    tr = [r for r in rows if r.get("split") == "train"]
    va = [r for r in rows if r.get("split") == "val"]
    fig, ax = plt.subplots(figsize=(7, 4))
    if tr:
        x = [r["tokens"] for r in tr]
        ax.plot(x, [r["main"] for r in tr], lw=0.8, label="train L_main")
        for d in range(len(tr[-1]["mtp"])):
            ax.plot(x, [r["mtp"][d] if d < len(r["mtp"]) else math.nan for r in tr], lw=0.8, label=f"train L_{d + 1}")
    if va:
        x = [r["tokens"] for r in va]
        ax.plot(x, [r["loss"] for r in va], "o-", label="val L_main")
        for d in range(1, 9):
            if f"loss_{d}" in va[-1]:
                ax.plot(x, [r.get(f"loss_{d}", math.nan) for r in va], "s--", label=f"val L_{d}")
    ax.set_xlabel("tokens")
    ax.set_ylabel("loss (nats/token)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    tmp = out / ".loss.png.tmp.png"
    fig.savefig(tmp, dpi=110)
    plt.close(fig)
    os.replace(tmp, out / "loss.png")


def train(cfg: TrainConfig, crash_at_step: int | None = None) -> dict:
    """Run (or resume) training; returns the last validation metrics. `crash_at_step`: test hook."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    distributed = world > 1
    if distributed and not dist.is_initialized():
        dist.init_process_group("gloo")
    rank = dist.get_rank() if distributed else 0
    main_proc = rank == 0
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    out = Path(cfg.out)
    torch.manual_seed(cfg.seed)
    random.seed(cfg.seed)
    np.random.seed(cfg.seed)

    train_data = TokenShards(cfg.data, "train")
    val_data = TokenShards(cfg.data, "val")
    batches = Batches(train_data, cfg.seq_len, cfg.seed)
    val_batches = Batches(val_data, cfg.seq_len, cfg.seed).fixed(cfg.eval_seqs, cfg.eval_batch)
    model = build_model(cfg, train_data.vocab_size, train_data.eos_token_id)
    depth = model.config.mtp_num_hidden_layers if cfg.mtp_depth is None else cfg.mtp_depth
    if model.mtp is None:
        depth = 0
    train_backbone = cfg.mode != "heads"
    if not train_backbone:
        for n, p in model.named_parameters():
            p.requires_grad_(n.startswith("mtp."))
    params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(_param_groups(params, cfg.weight_decay), lr=cfg.lr, betas=cfg.betas)

    step, tokens = 0, 0
    if main_proc:
        out.mkdir(parents=True, exist_ok=True)
    ckpt = latest_checkpoint(out) if out.exists() else None
    if ckpt is not None:  # exact resume: weights, optimizer, RNG, data position
        loaded = load_model(ckpt)
        with torch.no_grad():
            own = dict(model.named_parameters())
            for n, p in loaded.named_parameters():
                own[n].copy_(p)
        st = torch.load(ckpt / STATE, weights_only=False)
        optimizer.load_state_dict(st["optimizer"])
        set_rng_state(st["rng"])
        step, tokens = st["step"], st["tokens"]
    metrics_path = out / "metrics.jsonl"
    rows: list[dict] = []
    if main_proc:
        if metrics_path.exists():  # keep what the resumed-from checkpoint had seen; drop the rest
            rows = [r for r in map(json.loads, metrics_path.read_text().splitlines()) if r["step"] <= step]
        metrics_path.write_text("".join(json.dumps(r) + "\n" for r in rows))
        (out / "train_config.json").write_text(json.dumps(cfg.to_dict(), indent=1) + "\n")

    model.train()
    model.gradient_checkpointing = cfg.gradient_checkpointing
    obj = Objective(model, train_backbone, cfg.heads_target == "self", cfg.checkpoint_logits,
                    torch.bfloat16 if cfg.bf16 else None)
    runner: nn.Module = obj
    if distributed:
        from torch.nn.parallel import DistributedDataParallel as DDP

        runner = DDP(obj, find_unused_parameters=depth < model.config.mtp_num_hidden_layers)
    if cfg.compile:
        runner = torch.compile(runner)
    tokenizer_dir = cfg.data if (Path(cfg.data) / "tokenizer.json").exists() else cfg.init
    G = cfg.micro_batch * cfg.grad_accum * world
    tokens_per_step = G * cfg.seq_len

    from tqdm import tqdm

    bar = tqdm(total=cfg.max_steps, initial=step, disable=not (cfg.progress and main_proc), unit="step",
               dynamic_ncols=True, mininterval=2.0)
    t_start = time.perf_counter()
    last_val: dict = {}

    def log(row: dict) -> None:
        rows.append(row)
        with open(metrics_path, "a") as f:
            f.write(json.dumps(row) + "\n")

    def save() -> None:
        if main_proc:
            save_checkpoint(out, step, model, optimizer, {"tokens": tokens, "config": cfg.to_dict()},
                            tokenizer_dir, cfg.keep_checkpoints)
            _plot(out, rows)
        if distributed:
            dist.barrier()

    stopped_early = False
    while step < cfg.max_steps:
        t0 = time.perf_counter()
        weights = mtp_weights(cfg.mtp_schedule, depth, tokens, cfg.mtp_lambda, cfg.mtp_lambda_late,
                              cfg.mtp_lambda_switch_tokens, cfg.mtp_decay, cfg.mtp_constant) if depth else []
        w = torch.tensor(weights, dtype=torch.float32)
        lr = lr_at(step, cfg)
        for g in optimizer.param_groups:
            g["lr"] = lr
        main_sum, depth_sums = 0.0, [0.0] * depth
        for micro in range(cfg.grad_accum):
            ids = batches.micro_batch(step, micro, cfg.micro_batch, cfg.grad_accum, rank, world)
            sync = nullcontext() if not distributed or micro == cfg.grad_accum - 1 else runner.no_sync()
            with sync:
                res = runner(ids, w)
                (res[0] / cfg.grad_accum).backward()
            parts = res[1:].tolist()
            main_sum += parts[0] / cfg.grad_accum
            depth_sums = [a + b / cfg.grad_accum for a, b in zip(depth_sums, parts[1:])]
        grad_norm = torch.nn.utils.clip_grad_norm_([p for _, p in params], cfg.grad_clip if cfg.grad_clip > 0 else float("inf"))
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        step += 1
        tokens += tokens_per_step
        if distributed:  # report the global mean of the per-rank losses
            t = torch.tensor([main_sum, *depth_sums], dtype=torch.float64)
            dist.all_reduce(t)
            main_sum, *depth_sums = (t / world).tolist()
        dt = time.perf_counter() - t0
        if main_proc and (step % cfg.log_every == 0 or step == cfg.max_steps):
            log({"split": "train", "step": step, "tokens": tokens, "main": main_sum, "mtp": depth_sums,
                 "w": weights, "lr": lr, "grad_norm": float(grad_norm), "tok_s": tokens_per_step / dt})
        bar.update(1)
        bar.set_postfix_str(f"L {main_sum:.3f}" + "".join(f" L{d + 1} {v:.3f}" for d, v in enumerate(depth_sums))
                            + f" {tokens_per_step / dt:,.0f} tok/s")
        if crash_at_step is not None and step == crash_at_step:
            raise SimulatedCrash(f"simulated kill after step {step}")
        out_of_time = cfg.max_minutes is not None and (time.perf_counter() - t_start) / 60 > cfg.max_minutes
        if distributed:
            flag = torch.tensor([float(out_of_time)])
            dist.all_reduce(flag)
            out_of_time = flag.item() > 0
        if step % cfg.eval_every == 0 or step == cfg.max_steps or out_of_time:
            if main_proc:
                last_val = {"split": "val", "step": step, "tokens": tokens,
                            **evaluate(model, val_batches, depth)}
                log(last_val)
                bar.write(f"step {step}: val loss {last_val['loss']:.4f}"
                          + "".join(f" | L{d} {last_val[f'loss_{d}']:.3f} accept {last_val[f'accept_{d}']:.3f}"
                                    for d in range(1, depth + 1) if f"loss_{d}" in last_val))
            if distributed:
                dist.barrier()
        if step % cfg.save_every == 0 or step == cfg.max_steps or out_of_time:
            save()
        if out_of_time:
            stopped_early = True
            break
    bar.close()
    if main_proc:
        final = out / "model"
        m = model
        save_model(m, final, dtype=cfg.save_dtype)
        copy_tokenizer(tokenizer_dir, final)
        _plot(out, rows)
        if stopped_early:
            print(f"mtp train: stopped after {cfg.max_minutes} minutes at step {step}/{cfg.max_steps}")
    if distributed:
        dist.barrier()
    return last_val
