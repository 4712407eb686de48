"""Typed training config: a dataclass, presets, JSON files and `key=value` overrides (unknown keys fail)."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from ..config import ConfigError
from .loss import SCHEDULES

MODES = ("pretrain", "heads", "finetune")
HEADS_TARGETS = ("tokens", "self")
DEVICES = ("auto", "cpu", "cuda", "mps")
STRATEGIES = ("ddp", "fsdp")


@dataclass
class TrainConfig:
    data: str = ""                      # data folder built by `mtp data`
    out: str = ""                       # run folder: checkpoints/, metrics.jsonl, loss.png
    mode: str = "pretrain"              # pretrain | heads | finetune
    init: str | None = None             # checkpoint folder to start from (heads, finetune)
    model: dict[str, Any] = field(default_factory=dict)  # HF config keys for pretrain (vocab from the data;
                                                          # `model_type` picks the family, default qwen3_5_text)
    seq_len: int = 256
    micro_batch: int = 8
    grad_accum: int = 1
    max_steps: int = 100
    lr: float = 1e-3
    min_lr_ratio: float = 0.1           # cosine decays to lr * min_lr_ratio
    warmup_steps: int = 10
    weight_decay: float = 0.1
    betas: tuple[float, float] = (0.9, 0.95)
    grad_clip: float = 1.0              # 0 = off
    mtp_depth: int | None = None        # depths trained (default: the model's mtp_num_hidden_layers)
    mtp_schedule: str = "deepseek"      # deepseek | decay | constant
    mtp_lambda: float = 0.3
    mtp_lambda_late: float = 0.1
    mtp_lambda_switch_tokens: int | None = None  # deepseek: lambda -> mtp_lambda_late after this many tokens
    mtp_decay: float = 0.8
    mtp_constant: float = 1.0
    heads_target: str = "tokens"        # heads mode: "tokens" (true next tokens) | "self" (self-distillation)
    mtp_layers: int | None = None       # heads mode: train this many FRESH MTP layers (any MTP of `init` is dropped;
                                        # `mtp retrofit`), None: the init's own (a fresh one only where it has none)
    bf16: bool = False                  # bf16 autocast (on the training device's type)
    compile: bool = False               # torch.compile the objective (forward + loss; backward via AOTAutograd)
    gradient_checkpointing: bool = False
    checkpoint_logits: bool = False     # recompute head + CE in backward: one depth's logits alive at a time
    seed: int = 0
    device: str = "auto"                # auto (cuda when available, else cpu) | cpu | cuda | mps
    threads: int | None = None
    strategy: str = "ddp"               # under torchrun: ddp (replicate) | fsdp (FSDP2: shard weights, grads, optimizer)
    eval_every: int = 50
    eval_seqs: int = 64                 # validation windows per evaluation
    eval_batch: int = 8
    save_every: int = 50
    keep_checkpoints: int = 2
    log_every: int = 1
    progress: bool = True
    max_minutes: float | None = None    # stop (and save) after this wall time; the schedule is unchanged
    save_dtype: str = "float32"         # dtype of the final model/ export

    def __post_init__(self) -> None:
        self.betas = tuple(self.betas)
        self.validate()

    def validate(self) -> None:
        if self.mode not in MODES:
            raise ConfigError(f"train config key 'mode' is {self.mode!r}; expected one of {MODES}")
        if self.mtp_schedule not in SCHEDULES:
            raise ConfigError(f"train config key 'mtp_schedule' is {self.mtp_schedule!r}; expected one of {SCHEDULES}")
        if self.heads_target not in HEADS_TARGETS:
            raise ConfigError(f"train config key 'heads_target' is {self.heads_target!r}; expected one of {HEADS_TARGETS}")
        if self.heads_target == "self" and self.mode != "heads":
            raise ConfigError("train config key 'heads_target' = 'self' needs mode 'heads' (a frozen backbone teacher)")
        if self.mode in ("heads", "finetune") and not self.init:
            raise ConfigError(f"train config key 'init' (a checkpoint folder) is required in mode {self.mode!r}")
        if self.mode == "pretrain" and self.init:
            raise ConfigError("train config key 'init' is not used in mode 'pretrain' (use mode 'finetune')")
        for k in ("seq_len", "micro_batch", "grad_accum", "max_steps", "eval_every", "save_every", "eval_seqs",
                  "eval_batch", "keep_checkpoints", "log_every"):
            v = getattr(self, k)
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                raise ConfigError(f"train config key '{k}' must be a positive integer, got {v!r}")
        if self.warmup_steps < 0 or self.lr <= 0 or not 0 <= self.min_lr_ratio <= 1:
            raise ConfigError("train config keys 'warmup_steps' >= 0, 'lr' > 0, 0 <= 'min_lr_ratio' <= 1 required")
        if self.mtp_layers is not None and (self.mode != "heads" or self.mtp_layers < 1):
            raise ConfigError(f"train config key 'mtp_layers' ({self.mtp_layers}) needs mode 'heads' and a value >= 1")
        if self.mtp_depth is not None and self.mtp_depth < 0:
            raise ConfigError(f"train config key 'mtp_depth' must be >= 0, got {self.mtp_depth}")
        if self.device not in DEVICES:
            raise ConfigError(f"train config key 'device' is {self.device!r}; expected one of {DEVICES}")
        if self.strategy not in STRATEGIES:
            raise ConfigError(f"train config key 'strategy' is {self.strategy!r}; expected one of {STRATEGIES}")
        if not self.data:
            raise ConfigError("train config key 'data' (a folder built by `mtp data`) is required")
        if not self.out:
            raise ConfigError("train config key 'out' (the run folder) is required")

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> TrainConfig:
        known = {f.name for f in fields(cls)}
        for k in d:
            if k not in known:
                raise ConfigError(f"unknown train config key '{k}'")
        return cls(**d)


_SMALL_MODEL = dict(
    hidden_size=384, intermediate_size=1024, num_hidden_layers=8, full_attention_interval=4,
    num_attention_heads=6, num_key_value_heads=2, head_dim=64, linear_num_key_heads=6, linear_num_value_heads=6,
    linear_key_head_dim=64, linear_value_head_dim=64, linear_conv_kernel_dim=4, max_position_embeddings=4096,
    rope_theta=10000.0, partial_rotary_factor=0.25, tie_word_embeddings=True, mtp_num_hidden_layers=1,
    mtp_style="sequential",
)

PRESETS: dict[str, dict] = {
    # The shipped default model (models/code-small): trained on the stdlib corpus on 2 CPU cores.
    # 20.2M parameters, bf16 autocast + compiled objective, 2 threads; 6.1M tokens (0.74 epoch), about 1.4 h
    # on this machine alone (models/code-small/README.md has the exact run).
    "code-small": dict(mode="pretrain", model=_SMALL_MODEL, seq_len=512, micro_batch=4, grad_accum=1,
                       max_steps=3000, lr=1.5e-3, warmup_steps=100, min_lr_ratio=0.1, weight_decay=0.1,
                       mtp_schedule="deepseek", mtp_lambda=0.3, eval_every=400, eval_seqs=128, save_every=200,
                       bf16=True, compile=True, threads=2),
    # A few-second run for smoke tests and the experiments' shape.
    "tiny": dict(mode="pretrain", model=dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                 full_attention_interval=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                 linear_num_key_heads=2, linear_num_value_heads=2, linear_key_head_dim=16, linear_value_head_dim=16,
                 max_position_embeddings=1024, rope_theta=10000.0, mtp_num_hidden_layers=1),
                 seq_len=64, micro_batch=4, max_steps=20, lr=3e-3, warmup_steps=2, eval_every=10, save_every=10),
}


def parse_value(text: str) -> Any:
    """`key=value` override value: JSON when it parses (numbers, true/false/null, lists, objects), else a string."""
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def apply_overrides(d: dict, overrides: list[str]) -> dict:
    """Apply `key=value` / `model.key=value` overrides to a config dict (copy)."""
    d = json.loads(json.dumps(d))
    for o in overrides:
        if "=" not in o:
            raise ConfigError(f"override {o!r} must look like key=value")
        key, value = o.split("=", 1)
        target = d
        parts = key.split(".")
        for p in parts[:-1]:
            target = target.setdefault(p, {})
            if not isinstance(target, dict):
                raise ConfigError(f"override {o!r}: '{p}' is not a section")
        target[parts[-1]] = parse_value(value)
    return d


def load_config(path: str | Path | None = None, preset: str | None = None, overrides: list[str] | None = None) -> TrainConfig:
    """Preset, then the JSON file on top, then the overrides."""
    d: dict = {}
    if preset is not None:
        if preset not in PRESETS:
            raise ConfigError(f"unknown preset {preset!r}; presets: {sorted(PRESETS)}")
        d.update(json.loads(json.dumps(PRESETS[preset])))
    if path is not None:
        p = Path(path)
        if not p.exists():
            raise FileNotFoundError(f"train config {p} does not exist")
        try:
            d.update(json.loads(p.read_text()))
        except json.JSONDecodeError as e:
            raise ConfigError(f"{p}: not valid JSON ({e})") from None
    return TrainConfig.from_dict(apply_overrides(d, overrides or []))
