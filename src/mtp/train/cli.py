"""`mtp train` and `mtp heal` subcommands."""

from __future__ import annotations

import argparse
import contextlib
import errno
import json
import os
import sys
from pathlib import Path

# Write failures that are the machine's, not the input's: reported in one line (the previous checkpoint is intact).
WRITE_ERRORS = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EROFS)


def cmd_train(args) -> int:
    from .config import load_config
    from .trainer import train

    if args.config is None and args.preset is None:
        raise SystemExit("mtp train: give --config FILE or --preset NAME (see --list-presets)")
    cfg = load_config(args.config, args.preset, args.overrides + ([f"device={args.device}"] if args.device else []))
    if args.fresh:
        import shutil

        shutil.rmtree(Path(cfg.out) / "checkpoints", ignore_errors=True)
        (Path(cfg.out) / "latest").unlink(missing_ok=True)
    try:
        val = train(cfg)
    except OSError as e:  # e.g. a full disk while saving: the previous checkpoint is intact (train/state.py)
        if e.errno not in WRITE_ERRORS:
            raise
        raise SystemExit(f"mtp train: error: cannot write {e.filename or cfg.out}: {e.strerror or e}; the run's previous "
                         f"checkpoint (if any, named by {Path(cfg.out) / 'latest'}) is unchanged") from None
    if val:
        print(json.dumps({k: round(v, 5) if isinstance(v, float) else v for k, v in val.items()}))
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        # Everything is written and the process group destroyed, but gloo's worker threads can still hold tensors
        # whose teardown at interpreter exit aborts the process (SIGABRT, "terminate called without an active
        # exception": one 2-process CI run in three on 2026-12-04), and torchrun then fails the whole run: end here.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
    return 0


def cmd_heal(args) -> int:
    from .heal import heal

    try:
        report = heal(args.base, args.finetuned, args.out, train=args.train, data=args.data, steps=args.steps,
                      lr=args.lr, seq_len=args.seq_len, micro_batch=args.micro_batch, eval_seqs=args.eval_seqs,
                      threads=args.threads, seed=args.seed, device=args.device)
    except OSError as e:  # e.g. a full disk: graft writes all its files before it replaces any (io/files.py)
        if e.errno not in WRITE_ERRORS:
            raise
        raise SystemExit(f"mtp heal: error: cannot write {e.filename or args.out}: {e.strerror or e}; "
                         f"{args.out} is as it was before") from None
    print(json.dumps(report, indent=1))
    return 0


def cmd_retrofit(args) -> int:
    from . import retrofit

    common = dict(steps=args.steps, lr=args.lr, seq_len=args.seq_len, micro_batch=args.micro_batch,
                  eval_seqs=args.eval_seqs, eval_every=args.eval_every, threads=args.threads, device=args.device,
                  seed=args.seed, max_minutes=args.max_minutes)
    if args.fresh:
        import shutil

        shutil.rmtree(Path(args.out) / "checkpoints", ignore_errors=True)
        (Path(args.out) / "latest").unlink(missing_ok=True)
    try:
        with contextlib.redirect_stdout(sys.stderr):  # the trainer's progress lines: stdout is the report alone
            if args.style == "head":
                report = retrofit.retrofit_head(args.base, args.data, args.out, layers=args.layers, bf16=args.bf16,
                                                **common)
            else:
                report = retrofit.retrofit_masks(args.base, args.data, args.out, masks=args.masks, rank=args.lora_rank,
                                                 **common)
    except OSError as e:
        if e.errno not in WRITE_ERRORS:
            raise
        raise SystemExit(f"mtp retrofit: error: cannot write {e.filename or args.out}: {e.strerror or e}; the run's "
                         "previous checkpoint (if any) is unchanged") from None
    print(json.dumps(report, indent=1))
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    from .config import DEVICES, PRESETS

    p = sub.add_parser("train", help="train with the MTP objective (pretrain / heads / finetune)",
                       description="Config: the preset, then --config JSON on top, then key=value overrides "
                                   "(model.key=value for model config keys). Resumes from OUT/latest when present.")
    p.add_argument("--config", type=Path, default=None, help="JSON train config")
    p.add_argument("--preset", default=None, choices=sorted(PRESETS))
    p.add_argument("--device", default=None, choices=DEVICES,
                   help="auto (cuda when available), cpu, cuda, mps; same as the override device=...")
    p.add_argument("--fresh", action="store_true", help="ignore (delete) the run folder's checkpoints instead of resuming")
    p.add_argument("overrides", nargs="*", help="key=value overrides, e.g. data=DIR out=DIR max_steps=100")
    p.set_defaults(func=cmd_train)

    h = sub.add_parser("heal", help="graft a base checkpoint's mtp.* into a fine-tune that lost them (+ optional re-alignment)")
    h.add_argument("--base", type=Path, required=True, help="original checkpoint with mtp.* tensors")
    h.add_argument("--finetuned", type=Path, required=True, help="fine-tuned checkpoint without mtp.*")
    h.add_argument("--out", type=Path, required=True, help="output folder (a normal Qwen3.5 checkpoint)")
    h.add_argument("--train", action="store_true", help="re-align the grafted MTP by self-distillation (heads mode)")
    h.add_argument("--data", type=Path, default=None, help="data folder (`mtp data`) for --train and the acceptance report")
    h.add_argument("--steps", type=int, default=200)
    h.add_argument("--lr", type=float, default=1e-3)
    h.add_argument("--seq-len", type=int, default=256)
    h.add_argument("--micro-batch", type=int, default=8)
    h.add_argument("--eval-seqs", type=int, default=64)
    h.add_argument("--threads", type=int, default=None)
    h.add_argument("--device", default="auto", choices=DEVICES, help="auto: cuda when available, else cpu")
    h.add_argument("--seed", type=int, default=0)
    h.set_defaults(func=cmd_heal)

    r = sub.add_parser("retrofit", help="train MTP onto a frozen model that has none (a head, or mask tokens + gated LoRA)",
                       description="Trains on DATA's training split with the backbone frozen, resumes from OUT/latest, "
                                   "and reports the expected acceptance per draft position on the held-out split "
                                   "before and after (OUT/report.json); the model is written to OUT/model.")
    r.add_argument("--base", required=True, help="the model: an mtp checkpoint folder or any supported transformers "
                                                 "causal LM folder (Llama, Qwen2/3, Mistral, ...)")
    r.add_argument("--data", required=True, help="data folder (`mtp data`) tokenized with the base's tokenizer")
    r.add_argument("--out", required=True, type=Path, help="run folder")
    r.add_argument("--style", choices=("head", "masks"), default="head",
                   help="head: a DeepSeek/Qwen-style MTP module (self-distilled); masks: k mask tokens + gated LoRA + "
                        "sampler head (Apple, 2025)")
    r.add_argument("--layers", type=int, default=1, help="head: MTP layers")
    r.add_argument("--masks", type=int, default=3, help="masks: mask tokens k (drafts per forward)")
    r.add_argument("--lora-rank", type=int, default=16, help="masks: rank of the gated LoRA adapters")
    r.add_argument("--steps", type=int, default=400)
    r.add_argument("--lr", type=float, default=1e-3)
    r.add_argument("--seq-len", type=int, default=256)
    r.add_argument("--micro-batch", type=int, default=8)
    r.add_argument("--eval-seqs", type=int, default=64)
    r.add_argument("--eval-every", type=int, default=100, help="validate and checkpoint every N steps")
    r.add_argument("--max-minutes", type=float, default=None, help="stop (and save) after this wall time")
    r.add_argument("--bf16", action="store_true", help="head: bf16 autocast")
    r.add_argument("--threads", type=int, default=None)
    r.add_argument("--device", default="auto", choices=DEVICES)
    r.add_argument("--seed", type=int, default=0)
    r.add_argument("--fresh", action="store_true", help="ignore (delete) OUT's checkpoints instead of resuming")
    r.set_defaults(func=cmd_retrofit)
