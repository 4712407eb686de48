"""The trainer: pretrain / heads / finetune with the MTP objective, single process or `torchrun` (DDP or FSDP).

One optimizer step = `grad_accum` micro-batches per process; the global batch is
micro_batch x grad_accum x world_size sequences of `seq_len` tokens. AdamW, linear warm-up then cosine,
gradient clipping, optional autocast (bf16, on the training device's type), torch.compile of the objective
and activation checkpointing. Exact resume: weights (fp32), optimizer, RNG and the data position (= the step)
are restored from the newest checkpoint.

Devices: `device` auto = cuda when available, else cpu (mps when asked). Under torchrun each process takes
`cuda:LOCAL_RANK` and nccl on CUDA, gloo on CPU.

Strategy under torchrun (`strategy`): ddp replicates the model in every process; fsdp (FSDP2 `fully_shard`, CUDA
or CPU/gloo) shards weights, gradients and optimizer state over the processes: each backbone decoder layer, each
MTP layer, then the objective wrapper as the root (embeddings, the tied head, norms). Checkpoints are the same
under both: rank 0 gathers the full weights (HF layout) and the full optimizer state in `optimizer.state_dict()`'s
layout, so a run may resume under either strategy or in one process.
"""

from __future__ import annotations

import json
import math
import os
import random
import time
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from ..data.shards import TokenShards
from ..model import CausalLM, config_from_dict, load_model, save_model
from ..model.budget import build_on_meta
from ..model.device import resolve_device
from ..model.families import model_class_for
from .batches import Batches
from .config import TrainConfig
from .evaluate import evaluate
from .loss import mtp_objective, mtp_weights
from .plot import plot_metrics
from .state import STATE, copy_tokenizer, latest_checkpoint, save_checkpoint, set_rng_state


class Objective(nn.Module):
    """Wraps the model so DDP (and torch.compile) see one forward: ids [B, T], weights [D] ->
    [1 + 1 + D + 1] = (loss to backpropagate, L_main, L_1..L_D, MoE aux loss), the last ones detached.

    The MTP weights come in as a tensor so that a compiled objective does not recompile when the
    schedule changes them; autocast is entered inside so a compiled graph captures it."""

    def __init__(self, model: CausalLM, train_backbone: bool, distill: bool, checkpoint_logits: bool,
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
        return torch.stack([out.loss.float(), out.main.float(), *[d.float() for d in out.depths], out.aux.float()])


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Linear warm-up over warmup_steps, then cosine from lr to lr*min_lr_ratio at max_steps."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    t = (step - cfg.warmup_steps) / max(1, cfg.max_steps - cfg.warmup_steps)
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * min(1.0, t))))


def build_model(cfg: TrainConfig, vocab_size: int, eos_id: int | None) -> CausalLM:
    """pretrain: a fresh model from cfg.model (a HF config dict; `model_type` picks the family, default
    Qwen3.5); heads/finetune: the `init` checkpoint (a fresh MTP module added if it has none)."""
    if cfg.mode == "pretrain":
        mc = dict(cfg.model)
        if mc.get("vocab_size", vocab_size) < vocab_size:
            raise ValueError(f"model vocab_size {mc['vocab_size']} is smaller than the data's {vocab_size}")
        mc.setdefault("vocab_size", vocab_size)
        mc.setdefault("eos_token_id", eos_id)
        mc.setdefault("model_type", "qwen3_5_text")
        config = config_from_dict(mc)
        cls = model_class_for(config)
        # the fp32 weights must fit where they are built (a config with 10**9 layers is refused here, not by the OOM killer)
        build_on_meta(cls, config, torch.float32, "cpu", "train config key 'model'")
        model = cls(config)
        torch.manual_seed(cfg.seed)
        model.init_weights()
        return model
    model = load_model(cfg.init, dtype="float32")
    if model.config.vocab_size < vocab_size:
        raise ValueError(f"{cfg.init}: vocab_size {model.config.vocab_size} is smaller than the data's {vocab_size}")
    if cfg.mtp_layers is not None:  # a retrofit: fresh MTP layers whatever the checkpoint holds
        model.mtp = None
        model.config.mtp_num_hidden_layers = cfg.mtp_layers
    if model.mtp is None:
        if model.config.mtp_num_hidden_layers < 1:
            raise ValueError(f"{cfg.init}: config has mtp_num_hidden_layers=0; set it to train MTP heads")
        torch.manual_seed(cfg.seed)
        model.mtp = model.new_mtp_module()
        model.init_weights(modules=model.mtp)  # only the new MTP module is touched
    return model


def _param_groups(params: list[tuple[str, nn.Parameter]], weight_decay: float) -> list[dict]:
    decay = [p for n, p in params if p.ndim >= 2]
    no_decay = [p for n, p in params if p.ndim < 2]
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


@dataclass
class Run:
    """Everything one training run holds between steps."""

    cfg: TrainConfig
    out: Path
    rank: int
    world: int
    device: torch.device
    model: CausalLM
    runner: nn.Module  # the objective, possibly wrapped by DDP and torch.compile
    optimizer: torch.optim.Optimizer
    params: list[tuple[str, nn.Parameter]]
    batches: Batches
    val_batches: list[torch.Tensor]
    depth: int
    tokenizer_dir: str | None
    step: int = 0
    tokens: int = 0
    rows: list[dict] = field(default_factory=list)
    last_val: dict = field(default_factory=dict)
    fsdp_root: nn.Module | None = None  # the FSDP2 root (the objective) under strategy fsdp with > 1 process
    owns_group: bool = False  # `setup` created the process group (so `train` destroys it when done)

    @property
    def main_proc(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world > 1

    @property
    def sharded(self) -> bool:
        return self.fsdp_root is not None

    @property
    def tokens_per_step(self) -> int:
        return self.cfg.micro_batch * self.cfg.grad_accum * self.world * self.cfg.seq_len

    def log(self, row: dict) -> None:
        self.rows.append(row)
        with open(self.out / "metrics.jsonl", "a") as f:
            f.write(json.dumps(row) + "\n")


def setup(cfg: TrainConfig) -> Run:
    """Process group, device, data, model, optimizer; then resume from the newest checkpoint if there is one."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = resolve_device(cfg.device, local_rank, option="train config key 'device'")
    owns_group = world > 1 and not dist.is_initialized()
    if owns_group:
        if device.type == "cuda":
            torch.cuda.set_device(device)
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    rank = dist.get_rank() if world > 1 else 0
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    torch.manual_seed(cfg.seed)
    random.seed(cfg.seed)
    np.random.seed(cfg.seed)

    train_data = TokenShards(cfg.data, "train")
    batches = Batches(train_data, cfg.seq_len, cfg.seed)
    val_batches = Batches(TokenShards(cfg.data, "val"), cfg.seq_len, cfg.seed).fixed(cfg.eval_seqs, cfg.eval_batch)
    sharded = cfg.strategy == "fsdp" and world > 1  # one process: nothing to shard, the plain path
    model = build_model(cfg, train_data.vocab_size, train_data.eos_token_id)
    if not sharded:  # fully_shard moves each shard to the device itself: the whole model never sits on one GPU
        model = model.to(device)
    depth = 0 if model.mtp is None else (model.mtp.num_layers if cfg.mtp_depth is None else cfg.mtp_depth)
    train_backbone = cfg.mode != "heads"
    if not train_backbone:
        for n, p in model.named_parameters():
            p.requires_grad_(n.startswith("mtp."))

    model.train()
    model.gradient_checkpointing = cfg.gradient_checkpointing
    runner: nn.Module = Objective(model, train_backbone, cfg.heads_target == "self", cfg.checkpoint_logits,
                                  torch.bfloat16 if cfg.bf16 else None)
    fsdp_root = None
    if sharded:
        fsdp_root = runner = shard_fsdp(runner, device, world)
        if rank == 0:
            local = sum(p.to_local().numel() for p in model.parameters())
            total = sum(p.numel() for p in model.parameters())
            print(f"mtp train: fsdp over {world} processes ({dist.get_backend()}, {device.type}): "
                  f"{local:,} of {total:,} parameters held by rank 0", flush=True)
    elif world > 1:
        from torch.nn.parallel import DistributedDataParallel as DDP

        runner = DDP(runner, device_ids=[device.index] if device.type == "cuda" else None,
                     find_unused_parameters=depth < model.mtp.num_layers if model.mtp is not None else False)
    # after fully_shard, which replaces every parameter by its sharded DTensor (DDP keeps them)
    params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(_param_groups(params, cfg.weight_decay), lr=cfg.lr, betas=cfg.betas)
    if cfg.compile:
        runner = torch.compile(runner)
    tokenizer_dir = cfg.data if (Path(cfg.data) / "tokenizer.json").exists() else cfg.init
    run = Run(cfg, Path(cfg.out), rank, world, device, model, runner, optimizer, params, batches, val_batches,
              depth, tokenizer_dir, fsdp_root=fsdp_root, owns_group=owns_group)
    resume(run)
    return run


def shard_fsdp(objective: Objective, device: torch.device, world: int) -> nn.Module:
    """FSDP2 over the `world` processes: each backbone decoder layer (`model.model.layers[i]`), each MTP layer
    (`model.mtp.layers[i]`), then the objective as the root, which holds the rest: the embedding and the head tied
    to it (one parameter, one shard), norms, the MTP fc. Returns the objective, now an FSDPModule; its parameters
    are DTensors on `device`.

    The root is the wrapper, not the CausalLM: the objective calls model.hidden / head / mtp_hidden_states, never
    model.forward, and FSDP gathers a module's own parameters in that module's forward."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh(device.type, (world,))
    model = objective.model
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    if model.mtp is not None:
        for layer in model.mtp.layers:
            fully_shard(layer, mesh=mesh)
    fully_shard(objective, mesh=mesh)
    return objective


def _param_order(run: Run) -> list[str]:
    """Names of the optimizer's parameters in the order `optimizer.state_dict()` numbers them (group by group)."""
    names = {id(p): n for n, p in run.params}
    return [names[id(p)] for g in run.optimizer.param_groups for p in g["params"]]


def _optimizer_by_index(state: dict, order: list[str]) -> dict:
    """A full optimizer state keyed by parameter name (torch.distributed.checkpoint) -> `optimizer.state_dict()`'s
    layout (keyed 0..n-1 in `order`), the layout every checkpoint keeps."""
    index = {n: i for i, n in enumerate(order)}
    return {"state": {index[n]: v for n, v in state["state"].items()},
            "param_groups": [{**g, "params": [index[n] for n in g["params"]]} for g in state["param_groups"]]}


def _optimizer_by_name(state: dict, order: list[str]) -> dict:
    """The inverse of `_optimizer_by_index`."""
    return {"state": {order[i]: v for i, v in state["state"].items()},
            "param_groups": [{**g, "params": [order[i] for i in g["params"]]} for g in state["param_groups"]]}


def _full_model(run: Run) -> CausalLM | None:
    """FSDP: gather the full weights to rank 0 (a collective: every rank calls it) -> on rank 0 an unsharded CPU
    model holding them (for `save_model`), None elsewhere."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    state = get_model_state_dict(run.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if not run.main_proc:
        return None
    m = run.model
    with torch.device("meta"):
        plain = type(m)(m.config, with_mtp=m.mtp is not None)
    plain.load_state_dict(state, assign=True)
    if m.config.tie_word_embeddings:  # assign=True replaces parameters one by one: tie again
        plain.lm_head.weight = plain.model.embed_tokens.weight
    plain.source_path, plain.checkpoint_layout, plain.tokenizer = m.source_path, m.checkpoint_layout, m.tokenizer
    return plain


def _full_optimizer_state(run: Run) -> dict | None:
    """FSDP: gather the full optimizer state to rank 0 (a collective) -> `optimizer.state_dict()`'s layout on rank 0,
    None elsewhere."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    state = get_optimizer_state_dict(run.model, run.optimizer,
                                     options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    return _optimizer_by_index(state, _param_order(run)) if run.main_proc else None


def _load_sharded(run: Run, ckpt: Path, optimizer_state: dict) -> None:
    """FSDP resume: rank 0 reads the full weights (HF folder) and takes the full optimizer state; both are broadcast
    and each rank keeps its shards."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict, set_optimizer_state_dict

    opts = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
    weights = load_model(ckpt, dtype="float32").state_dict() if run.main_proc else {}
    set_model_state_dict(run.model, weights, options=opts)
    optim = _optimizer_by_name(optimizer_state, _param_order(run)) if run.main_proc else {}
    set_optimizer_state_dict(run.model, run.optimizer, optim, options=opts)


def resume(run: Run) -> None:
    """Exact resume from out/latest (weights, optimizer, RNG, data position); keep the metrics seen up to it."""
    out = run.out
    if run.main_proc:
        out.mkdir(parents=True, exist_ok=True)
    ckpt = latest_checkpoint(out) if out.exists() else None
    if ckpt is not None and run.sharded:
        # mmap: only rank 0 reads the optimizer tensors (then broadcasts them); the others need step and RNG
        st = torch.load(ckpt / STATE, weights_only=False, map_location="cpu", mmap=True)
        _load_sharded(run, ckpt, st["optimizer"])
    elif ckpt is not None:
        loaded = load_model(ckpt, dtype="float32")
        with torch.no_grad():
            own = dict(run.model.named_parameters())
            for n, p in loaded.named_parameters():
                own[n].copy_(p)
        st = torch.load(ckpt / STATE, weights_only=False, map_location=run.device)
        run.optimizer.load_state_dict(st["optimizer"])
    if ckpt is not None:
        set_rng_state(st["rng"])
        run.step, run.tokens = st["step"], st["tokens"]
    metrics_path = out / "metrics.jsonl"
    if run.main_proc:
        if metrics_path.exists():  # keep what the resumed-from checkpoint had seen; drop the rest
            run.rows = [r for r in map(json.loads, metrics_path.read_text().splitlines()) if r["step"] <= run.step]
        metrics_path.write_text("".join(json.dumps(r) + "\n" for r in run.rows))
        (out / "train_config.json").write_text(json.dumps(run.cfg.to_dict(), indent=1) + "\n")


@dataclass
class StepResult:
    """What one optimizer step measured: losses averaged over the global batch, and the step's settings."""

    main: float  # L_main, the next-token loss
    depths: list[float]  # L_d for d = 1..depth
    aux: float  # the MoE load-balancing loss (0 without MoE)
    weights: list[float]  # the MTP loss weights used
    lr: float
    grad_norm: float  # before clipping


def train_step(run: Run) -> StepResult:
    """One optimizer step over grad_accum micro-batches."""
    cfg = run.cfg
    weights = mtp_weights(cfg.mtp_schedule, run.depth, run.tokens, cfg.mtp_lambda, cfg.mtp_lambda_late,
                          cfg.mtp_lambda_switch_tokens, cfg.mtp_decay, cfg.mtp_constant) if run.depth else []
    w = torch.tensor(weights, dtype=torch.float32, device=run.device)
    lr = lr_at(run.step, cfg)
    for g in run.optimizer.param_groups:
        g["lr"] = lr
    sums = torch.zeros(1 + run.depth + 1, dtype=torch.float64, device=run.device)
    for micro in range(cfg.grad_accum):
        ids = run.batches.micro_batch(run.step, micro, cfg.micro_batch, cfg.grad_accum, run.rank, run.world)
        ids = ids.to(run.device, non_blocking=True)
        last = micro == cfg.grad_accum - 1
        if run.sharded:  # FSDP2's no_sync: keep the unsharded gradients until the last micro-batch reduce-scatters
            run.fsdp_root.set_requires_gradient_sync(last)
            sync = nullcontext()
        else:
            sync = nullcontext() if not run.distributed or last else run.runner.no_sync()
        with sync:
            res = run.runner(ids, w)
            (res[0] / cfg.grad_accum).backward()
        sums += res[1:].detach().double() / cfg.grad_accum
    clip = cfg.grad_clip if cfg.grad_clip > 0 else float("inf")
    grad_norm = torch.nn.utils.clip_grad_norm_([p for _, p in run.params], clip)
    if hasattr(grad_norm, "full_tensor"):  # FSDP: a replicated DTensor
        grad_norm = grad_norm.full_tensor()
    run.optimizer.step()
    run.optimizer.zero_grad(set_to_none=True)
    run.step += 1
    run.tokens += run.tokens_per_step
    if run.distributed:  # report the global mean of the per-rank losses
        dist.all_reduce(sums)
        sums /= run.world
    main, *depths, aux = sums.tolist()
    return StepResult(main, depths, aux, weights, lr, float(grad_norm))


def validate(run: Run, bar) -> None:
    """Evaluate on the fixed validation windows (main process; under FSDP every process, as the layers' weights are
    gathered in their forward) and log the metrics (main process)."""
    metrics = None
    if run.sharded:
        run.fsdp_root.unshard()  # the root's own weights (embeddings, head, norms): evaluate never calls its forward
        metrics = evaluate(run.model, run.val_batches, run.depth)
        run.fsdp_root.reshard()
    elif run.main_proc:
        metrics = evaluate(run.model, run.val_batches, run.depth)
    if run.main_proc:
        run.last_val = {"split": "val", "step": run.step, "tokens": run.tokens, **metrics}
        run.log(run.last_val)
        v = run.last_val
        bar.write(f"step {run.step}: val loss {v['loss']:.4f}"
                  + "".join(f" | L{d} {v[f'loss_{d}']:.3f} accept {v[f'accept_{d}']:.3f}"
                            for d in range(1, run.depth + 1) if f"loss_{d}" in v))
    if run.distributed:
        dist.barrier()


def save(run: Run) -> None:
    """Checkpoint (main process, atomically; under FSDP gathered to it first) and redraw the plot."""
    model, optimizer = (_full_model(run), _full_optimizer_state(run)) if run.sharded else (run.model, run.optimizer)
    if run.main_proc:
        save_checkpoint(run.out, run.step, model, optimizer, {"tokens": run.tokens, "config": run.cfg.to_dict()},
                        run.tokenizer_dir, run.cfg.keep_checkpoints)
        plot_metrics(run.out, run.rows)
    if run.distributed:
        dist.barrier()


def _out_of_time(run: Run, t_start: float) -> bool:
    late = run.cfg.max_minutes is not None and (time.perf_counter() - t_start) / 60 > run.cfg.max_minutes
    if run.distributed:  # every rank must stop at the same step
        flag = torch.tensor([float(late)], device=run.device)
        dist.all_reduce(flag)
        late = flag.item() > 0
    return late


def finish(run: Run, stopped_early: bool) -> None:
    """Write the final HF-layout model (main process; under FSDP gathered to it first) and the plot."""
    model = _full_model(run) if run.sharded else run.model
    if run.main_proc:
        final = run.out / "model"
        save_model(model, final, dtype=run.cfg.save_dtype)
        copy_tokenizer(run.tokenizer_dir, final)
        plot_metrics(run.out, run.rows)
        if stopped_early:
            print(f"mtp train: stopped after {run.cfg.max_minutes} minutes at step {run.step}/{run.cfg.max_steps}")
    if run.distributed:
        dist.barrier()


def accept_postfix(val: dict, depth: int) -> str:
    """The last validation's expected acceptance per draft position, for the progress bar ('' before the first)."""
    accept = [val[f"accept_pos_{d}"] for d in range(1, depth + 1) if f"accept_pos_{d}" in val]
    return f" | val accept {' '.join(f'{a:.2f}' for a in accept)}" if accept else ""


def train(cfg: TrainConfig) -> dict:
    """Run (or resume) training; returns the last validation metrics."""
    from tqdm import tqdm

    run = setup(cfg)
    bar = tqdm(total=cfg.max_steps, initial=run.step, disable=not (cfg.progress and run.main_proc), unit="step",
               dynamic_ncols=True, mininterval=2.0)
    t_start = time.perf_counter()
    stopped_early = False
    while run.step < cfg.max_steps:
        t0 = time.perf_counter()
        r = train_step(run)
        tok_s = run.tokens_per_step / (time.perf_counter() - t0)
        if run.main_proc and (run.step % cfg.log_every == 0 or run.step == cfg.max_steps):
            run.log({"split": "train", "step": run.step, "tokens": run.tokens, "main": r.main, "mtp": r.depths,
                     **({"aux": r.aux} if r.aux else {}), "w": r.weights, "lr": r.lr, "grad_norm": r.grad_norm,
                     "tok_s": tok_s})
        bar.update(1)
        bar.set_postfix_str(f"L {r.main:.3f}" + "".join(f" L{d + 1} {v:.3f}" for d, v in enumerate(r.depths))
                            + f" {tok_s:,.0f} tok/s" + accept_postfix(run.last_val, run.depth))
        late = _out_of_time(run, t_start)
        if run.step % cfg.eval_every == 0 or run.step == cfg.max_steps or late:
            validate(run, bar)
        if run.step % cfg.save_every == 0 or run.step == cfg.max_steps or late:
            save(run)
        if late:
            stopped_early = True
            break
    bar.close()
    finish(run, stopped_early)
    if run.owns_group:  # left to interpreter exit, gloo's threads were sometimes torn down still joinable: the
        dist.destroy_process_group()  # process aborted ("terminate called without an active exception") after saving
    return run.last_val
