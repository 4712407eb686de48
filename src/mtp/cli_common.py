"""What the subcommands share: the model options (`--model` folder or hub id, `--dtype`, `--device`,
`--threads`, `--strict`), the sampling options, `--draft-tokens` parsing and the missing-extra message."""

from __future__ import annotations

import argparse
import importlib
import os
from pathlib import Path

DEFAULT_MODEL = Path(__file__).resolve().parents[2] / "models" / "code-small"
DEVICES = ("auto", "cpu", "cuda", "mps")


def default_model_path() -> Path:
    """$MTP_MODEL, else the model shipped in the repository (models/code-small). An empty $MTP_MODEL is an error (it
    would otherwise be the current folder)."""
    env = os.environ.get("MTP_MODEL")
    if env is not None and not env.strip():
        raise SystemExit("mtp: $MTP_MODEL is set but empty: name a checkpoint folder or hub id, or unset it for the shipped model")
    return Path(env) if env is not None else DEFAULT_MODEL


def checkpoint_arg(value: str) -> str:
    """--model's type: a non-empty folder or hub id (`--model ''` is a mistake, not a request for the default)."""
    if not value.strip():
        raise argparse.ArgumentTypeError("must name a checkpoint folder or a hub id, got an empty string "
                                         "(leave --model out for the shipped model)")
    return value


def require_extra(extra: str, *modules: str) -> None:
    """Exit with one line naming the extra to install when one of `modules` is not importable (no traceback)."""
    missing = []
    for m in modules:
        try:
            importlib.import_module(m)
        except ImportError:
            missing.append(m)
    if missing:
        raise SystemExit(f"mtp: this command needs the '{extra}' extra ({', '.join(missing)} not installed): "
                         f"pip install \"mtp[{extra}]\"")


def parse_draft_tokens(value: str) -> int | str | None:
    """'auto' | '0'..'8' -> 'auto' | None (plain decoding) | k."""
    if value == "auto":
        return "auto"
    try:
        k = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--draft-tokens must be an integer 0..8 or 'auto', got {value!r}") from None
    if not 0 <= k <= 8:
        raise argparse.ArgumentTypeError(f"--draft-tokens must be in 0..8 or 'auto', got {k}")
    return k or None


def add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", type=checkpoint_arg, default=None,
                   help="checkpoint folder (HF layout) or hub id org/name; default: the shipped model ($MTP_MODEL)")
    p.add_argument("--revision", default=None, help="hub revision (branch, tag or commit) when --model is a hub id")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                   help="weights and activations (auto: the checkpoint's)")
    p.add_argument("--quantize", default=None, choices=["int8", "int4", "none"],
                   help="weight-only quantization of the linear layers and experts, bf16 activations (the MTP's input "
                        "projection stays bf16): int8 (per-channel scales) or int4 (groups of 128, asymmetric); the "
                        "quantized layers then hold only their codes. Default: an int4 release (GPTQ/AWQ 4-bit, "
                        "compressed-tensors int4) runs its own codes as int4 on the CPU, where the kernel takes its "
                        "group size, and an int8 one with a scale per channel (compressed-tensors W8A8 / W8A16) as "
                        "int8; any other checkpoint loads as stored (FP8 and other 8-bit releases decoded to --dtype). "
                        "none: decode those too")
    p.add_argument("--device", default="auto", choices=DEVICES, help="auto: cuda when available, else cpu")
    p.add_argument("--threads", type=int, default=None,
                   help="torch CPU threads (default: chosen from the cores that are free now, see `auto_threads`)")
    p.add_argument("--strict", action="store_true",
                   help="refuse a checkpoint whose weights hold NaN or Inf (default: load it with a warning naming the tensors)")


def model_name(args) -> str:
    """The --model value, or the default model's path."""
    return str(args.model) if args.model is not None else str(default_model_path())


def resolve_quantize(args, device=None) -> None:
    """--quantize's default, in place: "int4" for an int4 release (`Quantization.int4`) loaded on the CPU (its codes
    run as published: a quarter of the bf16 weight's bytes, the load a third of decoding them), "int8" for an int8
    release in the int8 kernel's form (`Quantization.int8`: its codes run as published, half the bytes), else None;
    "none" -> None. A config that does not parse is left to the loader, which names the key."""
    if args.quantize == "none":
        args.quantize = None
        return
    if args.quantize is not None or getattr(args, "shape", None) or (device is not None and device.type != "cpu"):
        return
    from .config import ConfigError, read_config_file
    from .config.quantization import parse_quantization
    from .io.hub import HubError, resolve_checkpoint

    try:
        path = resolve_checkpoint(model_name(args), revision=args.revision)
        quant = parse_quantization(read_config_file(path / "config.json").get("quantization_config"))
    except (ConfigError, HubError):  # (the loader reports a bad folder, hub id or config with its own message)
        return
    if quant is not None and quant.int4:
        args.quantize = "int4"
    elif quant is not None and quant.int8:
        args.quantize = "int8"


def load_from_args(args):
    """The model the options name, on the device they name, for inference (`load_model(release=True)`): the quantized
    layers keep only their codes, the bf16 layers on qmatmul's product only their packed copies."""
    import torch

    from .model import load_model
    from .model.device import resolve_device

    torch.set_num_threads(args.threads or auto_threads())
    name = model_name(args)
    if args.model is None and not Path(name).exists():
        raise SystemExit(f"mtp: model folder {name} does not exist (pass --model PATH or a hub id)")
    device = resolve_device(args.device)
    if hasattr(args, "quantize"):
        resolve_quantize(args, device)
    model = load_model(name, dtype=args.dtype, device=device, revision=args.revision,
                       quantize=getattr(args, "quantize", None), strict=getattr(args, "strict", False), release=True)
    if bits := draft_precision(getattr(args, "draft_quantize", "none"), model):
        model.quantize_drafts(bits)
    if hasattr(args, "draft_vocab"):  # (commands that draft: --draft-vocab's choice -> a size or None)
        args.draft_vocab = draft_vocab_size(args.draft_vocab, model)
    return model


def draft_precision(choice: str, model) -> str | None:
    """--draft-quantize for `model` -> the `quantize_drafts` bits, or None. "auto": int4 where it is known to pay - a
    bf16, int8 or int4 model on the CPU with an MTP and qmatmul's kernels (the shipped model at k = 3, generation only:
    on a Zen 4 int8 drafts gave 2.27-2.42x plain instead of 1.97-1.99x and int4 the same as int8; on an AMX Xeon int4
    2.00-2.02x, int8 1.85-1.89x, bf16 1.57x, at 3.14 tokens a round against 3.19: a draft step is mostly its head's
    bytes; docs/decisions.md, 2026-12-04 second session and 2026-12-05; an int8 model at k = 4: 1.62x its plain with
    int4 drafts, 1.44x with int8 ones, 2026-12-06 fifth session; an int4 model, whose drafts only gain an int4 input
    projection: k = 3 0.556 -> 0.528 s for the bench prompts, sixth session) - else None."""
    if choice == "none":
        return None
    if choice != "auto":
        return choice
    import torch

    from .model import qmatmul

    fits = model.has_mtp and model.device.type == "cpu" and model.dtype == torch.bfloat16 and qmatmul.available()
    return "int4" if fits else None


def draft_vocab_size(choice: str | int, model) -> int | None:
    """--draft-vocab for `model` -> the number of most frequent tokens to draft over, or None (the full vocabulary).
    "auto": `DraftVocab.auto_size` (the most frequent tokens making 95% of the model folder's token_frequencies.json;
    none where the folder has no such file)."""
    if choice == "none":
        return None
    if choice == "auto":
        from .decode.draft_vocab import DraftVocab

        return DraftVocab.auto_size(model)
    return int(choice)


def _vocab_choice(text: str) -> str | int:
    if text in ("auto", "none"):
        return text
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"expected auto, none or a number of tokens >= 1, got {text!r}")
    return int(text)


def auto_threads() -> int:
    """CPU threads for decoding: the cores this process may use minus those other processes keep busy now (the
    1-minute load average). On a loaded machine a second thread waits at every barrier for a core someone else
    holds: measured 958 ms vs 23 ms per step for 2 vs 1 threads on a shared 2-core machine (docs/decisions.md)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    try:
        busy = os.getloadavg()[0]
    except OSError:
        busy = 0.0
    return max(1, min(cores, round(cores - busy)))


def add_sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-new-tokens", type=int, default=128)
    # None = the model's generation_config.json, else greedy without a penalty (io/generation_config.py)
    p.add_argument("--temperature", type=float, default=None, help="0 = greedy (default, unless the model's "
                   "generation_config.json samples)")
    p.add_argument("--top-k", type=int, default=None)
    p.add_argument("--top-p", type=float, default=None)
    p.add_argument("--repetition-penalty", type=float, default=None,
                   help="1 = none (default: the model's generation_config.json, else 1)")
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--draft-tokens", type=parse_draft_tokens, default="auto",
                   help="MTP drafts per step: 0 = plain decoding, 1..8, or 'auto' (default)")
    p.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    add_draft_args(p)


def add_compile_arg(p: argparse.ArgumentParser, default: bool = False) -> None:
    """--compile / --no-compile: run the decode rounds as compiled graphs (decode/compiled.py)."""
    p.add_argument("--compile", action=argparse.BooleanOptionalAction, default=default,
                   help="run the decode rounds as compiled graphs (torch.compile; CUDA graphs on GPU). The first use of "
                        "each graph on a machine compiles it (minutes on CPU); later runs read the disk cache "
                        f"(~/.cache/mtp/inductor). Default: {'on' if default else 'off'}")


def add_draft_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--draft-vocab", type=_vocab_choice, default="auto", metavar="auto|none|N",
                   help="draft over the N most frequent tokens (token_frequencies.json beside the model); output is "
                        "unchanged, the draft head is V/N times cheaper. auto (default): the most frequent tokens "
                        "that make 95%% of the counted ones where the model folder has the file (4,224 of the "
                        "shipped model's 8,192), else the full vocabulary; none: the full vocabulary")
    p.add_argument("--draft-quantize", default="auto", choices=["auto", "none", "int8", "int4"],
                   help="run the MTP layers and a copy of their head in int8 / int4 for drafting (the backbone and the "
                        "output are unchanged; the draft step reads 2-4x fewer bytes). auto (default): int4 for a bf16, "
                        "int8 or int4 model on the CPU (an int8 model's MTP layers are requantized; an int4 model's "
                        "gets its input projection in int4), else none")


def sampling_kwargs(args, model) -> dict:
    """temperature / top_k / top_p / repetition_penalty: the flags given, else the model folder's
    generation_config.json, else greedy without a penalty."""
    from .io.generation_config import sampling_defaults

    out = {"temperature": 0.0, "top_k": None, "top_p": None, "repetition_penalty": 1.0}
    out.update(sampling_defaults(model.source_path))
    for key in out:
        if getattr(args, key) is not None:
            out[key] = getattr(args, key)
    return out
