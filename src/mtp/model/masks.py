"""Mask tokens with gated LoRA and a sampler head (after Apple's "Your LLM Knows the Future", 2025): a model trained
without MTP learns to predict the k tokens after a block of k mask tokens appended to its input, while its outputs on
ordinary tokens stay bit for bit what they were.

`MaskAdapter.attach(model)` adds, to any family's model, without changing one of its parameters or names:
- k mask tokens, ids V..V+k-1 (V = the model's vocabulary): a pre-hook on `model.model.embed_tokens` maps them to the
  adapter's own embeddings [k, H] and records the forward's gate = (ids >= V) [B, T];
- gated LoRA on every linear layer of the decoder layers: out + gate * B(A(x)) * scale, applied with `torch.where`,
  so an ordinary token's output is the base layer's output itself (the same bits, not a sum with zero);
- the sampler head: a two-layer MLP over [norm(z_i); norm(embed(y_prev))] added to z_i (the hidden state at mask
  i), read by the model's own head: draft i conditions on the token before it (the previous draft, or the token the
  backbone emitted), so the k drafts of one block form one continuation.
Everything the adapter holds lives outside the model's module tree (`model.__dict__`), so `save_model` writes the
base checkpoint unchanged; the adapter is saved beside it (`MASKS_FILE`, `MASKS_CONFIG`) and `load_model` attaches it
when the folder has one. Decoding with it: `decode/masks.py`; training: `train/masks.py`.
"""

from __future__ import annotations

import json
import math
import threading
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from ..io.files import FolderWriter, write_safetensors
from ..io.safetensors_mmap import SafetensorsFile

MASKS_FILE = "masks_adapter.safetensors"
MASKS_CONFIG = "masks_config.json"

_GATE = threading.local()  # the gate [B, T] of the forward in progress on this thread (set by the embedding pre-hook)


@dataclass
class MasksConfig:
    """`masks_config.json`: k mask tokens (ids vocab_size..vocab_size+k-1), LoRA rank and scale."""

    masks: int = 3
    rank: int = 16
    alpha: float = 16.0
    vocab_size: int = 0  # the base model's; mask token i has id vocab_size + i

    def validate(self, where: str = MASKS_CONFIG) -> None:
        for key in ("masks", "rank", "vocab_size"):
            v = getattr(self, key)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"{where}: key '{key}' must be a positive integer, got {v!r}")
        if self.masks > 8:  # decode/round.py's MAX_DRAFT: the drafts one round can verify
            raise ValueError(f"{where}: key 'masks' is {self.masks}: at most 8 mask tokens (drafts per round)")
        if not isinstance(self.alpha, (int, float)) or not math.isfinite(self.alpha) or self.alpha <= 0:
            raise ValueError(f"{where}: key 'alpha' must be a number > 0, got {self.alpha!r}")

    @property
    def mask_ids(self) -> list[int]:
        return list(range(self.vocab_size, self.vocab_size + self.masks))


class LoRA(nn.Module):
    """A [r, in], B [out, r] (B starts at zero: the adapter starts as the identity on mask tokens too)."""

    def __init__(self, fan_in: int, fan_out: int, rank: int, scale: float):
        super().__init__()
        self.A = nn.Parameter(torch.randn(rank, fan_in) / math.sqrt(fan_in))
        self.B = nn.Parameter(torch.zeros(fan_out, rank))
        self.scale = scale

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(F.linear(x, self.A.to(x.dtype)), self.B.to(x.dtype)) * self.scale


class SamplerHead(nn.Module):
    """z [..., H] (hidden at a mask) and e [..., H] (embedding of the token before it) -> z + fc2(silu(fc1([nz; ne])));
    fc2 starts at zero (the sampler starts as the identity)."""

    def __init__(self, hidden: int, eps: float = 1e-6):
        super().__init__()
        self.norm_z = nn.RMSNorm(hidden, eps=eps)
        self.norm_e = nn.RMSNorm(hidden, eps=eps)
        self.fc1 = nn.Linear(2 * hidden, hidden, bias=False)
        self.fc2 = nn.Linear(hidden, hidden, bias=False)
        nn.init.zeros_(self.fc2.weight)

    def forward(self, z: torch.Tensor, e: torch.Tensor) -> torch.Tensor:
        return z + self.fc2(F.silu(self.fc1(torch.cat([self.norm_z(z), self.norm_e(e)], dim=-1))))


def lora_targets(model) -> list[tuple[str, nn.Linear]]:
    """Every linear layer of the backbone's decoder layers (not the embedding, the head or an MTP module)."""
    return [(f"model.layers.{name}", m) for name, m in model.model.layers.named_modules() if isinstance(m, nn.Linear)]


class MaskAdapter(nn.Module):
    """The mask embeddings [k, H], one gated LoRA per target linear layer, and the sampler head (module docstring)."""

    def __init__(self, model, config: MasksConfig):
        super().__init__()
        config.validate()
        self.config = config
        H = model.config.hidden_size
        emb = model.model.embed_tokens.weight.detach().float()
        # new tokens start at the mean embedding (plus a little noise, so the k masks are told apart)
        gen = torch.Generator().manual_seed(0)
        init = emb.mean(0, keepdim=True) + emb.std() * 0.1 * torch.randn(config.masks, H, generator=gen)
        self.mask_embed = nn.Parameter(init)
        scale = config.alpha / config.rank
        self.lora = nn.ModuleDict({key(name): LoRA(m.in_features, m.out_features, config.rank, scale)
                                   for name, m in lora_targets(model)})
        self.sampler = SamplerHead(H)
        self.handles: list = []

    # ------------------------------------------------------------------ attach / detach
    @classmethod
    def attach(cls, model, config: MasksConfig, state: dict[str, torch.Tensor] | None = None) -> MaskAdapter:
        """Install the adapter on `model` (hooks; no parameter or name of the model changes) -> the adapter, also
        `model.masks`. `state`: the adapter's tensors (a saved adapter)."""
        if model.__dict__.get("masks") is not None:
            raise ValueError("this model already has a masks adapter")
        if config.vocab_size != model.config.vocab_size:
            raise ValueError(f"masks adapter for vocab_size {config.vocab_size}, the model has {model.config.vocab_size}")
        adapter = cls(model, config)
        if state is not None:
            adapter.load_state_dict(state)
        # the model's dtype (a bf16 model's hidden states meet the sampler head); training keeps fp32 models
        adapter.to(device=model.device, dtype=model.dtype)
        V = config.vocab_size
        emb = model.model.embed_tokens

        def embed_pre(module, args):
            ids = args[0]
            gate = ids >= V
            _GATE.gate = gate if bool(gate.any()) else None
            _GATE.which = (ids - V).clamp(min=0) if _GATE.gate is not None else None
            return (ids.clamp(max=V - 1),) + tuple(args[1:])

        adapter.handles.append(emb.register_forward_pre_hook(embed_pre))
        adapter.handles.append(emb.register_forward_hook(adapter._embed_hook))
        for name, m in lora_targets(model):
            adapter.handles.append(m.register_forward_hook(adapter._lora_hook(adapter.lora[key(name)])))
        adapter.unfuse(model)
        model.__dict__["masks"] = adapter
        return adapter

    @staticmethod
    def unfuse(model) -> None:
        """The fused q|k|v / gate|up matmul of inference would bypass the LoRA hooks: each projection runs on its own
        (`CausalLM.prepare_for_inference` calls this again after fusing)."""
        for m in model.modules():
            if "_fused" in m.__dict__:
                m.__dict__["_fused"] = None

    def detach_from(self, model) -> None:
        for h in self.handles:
            h.remove()
        self.handles = []
        model.__dict__.pop("masks", None)

    # ------------------------------------------------------------------ hooks
    def _embed_hook(self, module, args, out):
        """Mask positions take the adapter's embeddings: out [B, T, H]; the pre-hook kept the gate, and the mask
        index of each is recorded in `_GATE.which` [B, T]."""
        gate = _GATE.gate
        if gate is None:
            return out
        which = _GATE.which
        own = self.mask_embed.to(out.dtype)[which]  # [B, T, H]
        return torch.where(gate[..., None], own, out)

    @staticmethod
    def _lora_hook(lora: LoRA):
        def hook(module, args, out):
            gate = getattr(_GATE, "gate", None)
            if gate is None or out.shape[:-1] != gate.shape:
                return out
            return torch.where(gate[..., None], out + lora(args[0]), out)

        return hook

    # ------------------------------------------------------------------ the sampler chain
    def draft_logits(self, model, z: torch.Tensor, prev: torch.Tensor, tokens: torch.Tensor | None = None) -> torch.Tensor:
        """Logits of the k drafts of a block: z [B, k, H] (hidden at the masks), prev [B] (the token before the block's
        first prediction). `tokens` [B, k-1]: teacher-forced previous tokens for drafts 2..k (training), else each
        draft conditions on the argmax of the one before. Returns [B, k, V]."""
        out = []
        last = prev
        for i in range(z.shape[1]):
            s = self.sampler(z[:, i], model.model.embed_tokens(last).to(z.dtype))
            logits = model.head(s)
            out.append(logits)
            if i + 1 < z.shape[1]:
                last = tokens[:, i] if tokens is not None else logits.argmax(-1)
        return torch.stack(out, 1)

    # ------------------------------------------------------------------ save / load
    def save(self, path: str | Path) -> None:
        """MASKS_FILE + MASKS_CONFIG into the folder `path` (staged and renamed together)."""
        with FolderWriter(Path(path), replace_weights=False) as w:
            self.write(w)

    def write(self, w: FolderWriter) -> None:
        """Stage MASKS_FILE + MASKS_CONFIG in a folder writer (`save_model` writes them with the checkpoint)."""
        state = {k: v.detach().float().contiguous().cpu() for k, v in self.state_dict().items()}
        w.write(MASKS_FILE, lambda f: write_safetensors(f, state, {"format": "pt"}))
        w.write_text(MASKS_CONFIG, json.dumps(asdict(self.config), indent=1) + "\n")


def key(name: str) -> str:
    """A module name as a ModuleDict key (no dots)."""
    return name.replace(".", "__")


def load_adapter(model, path: str | Path) -> MaskAdapter:
    """Attach the adapter saved in folder `path` (MASKS_CONFIG + MASKS_FILE) to `model`; errors name the file."""
    path = Path(path)
    try:
        data = json.loads((path / MASKS_CONFIG).read_text())
        config = MasksConfig(**data)
    except (OSError, json.JSONDecodeError, TypeError) as e:
        raise ValueError(f"{path / MASKS_CONFIG}: not a masks config ({e})") from None
    config.validate(str(path / MASKS_CONFIG))
    with SafetensorsFile(path / MASKS_FILE) as files:
        state = {k: files.tensor(k).float().clone() for k in files.keys()}
    try:
        return MaskAdapter.attach(model, config, state)
    except RuntimeError as e:  # load_state_dict: missing / unexpected / wrong shape
        raise ValueError(f"{path / MASKS_FILE}: does not fit this model ({str(e).splitlines()[0]})") from None
