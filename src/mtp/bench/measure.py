"""Interleaved end-to-end measurement: every configuration on the same weights, prompts and threads.

Runs go A B C … C B A … (the order reverses every repeat so slow drift of the machine cancels), each
run is one greedy generation of exactly `max_new_tokens` tokens (EOS stops disabled, so every
configuration does the same work), timed with the wall clock around the call for `mtp` and
transformers alike. Peak memory is the resident set's high-water mark (VmHWM), reset before each run
where Linux allows it — no tracemalloc, which would slow the run it measures.
"""

from __future__ import annotations

import gc
import resource
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..decode import generate
from .prompts import Prompt

PLAIN = "mtp plain"
HF = "transformers"
HF_MTP = "transformers use_mtp"  # transformers' own MTP speculative decoding (`generate(use_mtp=True)`)


@dataclass(frozen=True)
class Variant:
    """How the model runs: weights' dtype, int8/int4 quantization, reduced draft vocabulary (its size; 0: the full
    vocabulary; None: the command line's), compiled rounds, the drafts' precision (--draft-quantize's choices; None:
    the command line's). `name` "" is the default (the command line's --dtype / --quantize / --draft-vocab /
    --compile / --draft-quantize)."""

    name: str = ""
    dtype: str = "auto"
    quantize: str | None = None
    draft_vocab: int | None = None
    compiled: bool = False
    draft_quantize: str | None = None

    @property
    def model_key(self) -> tuple[str, str | None, str | None]:
        return self.dtype, self.quantize, self.draft_quantize

    @classmethod
    def parse(cls, spec: str) -> Variant:
        """'bf16', 'int8', 'fp32', 'bf16+vocab4096', 'bf16+vocab-full', 'int8+compile', 'bf16+draft-int8' -> a
        Variant."""
        parts = spec.strip().split("+")
        dtypes = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16", "auto": "auto"}
        head, vocab, compiled, drafts = parts[0], None, False, None
        for extra in parts[1:]:
            if extra == "compile":
                compiled = True
            elif extra.startswith("vocab") and extra[5:].isdigit() and int(extra[5:]) > 0:
                vocab = int(extra[5:])
            elif extra == "vocab-full":
                vocab = 0
            elif extra.startswith("draft-") and extra.removeprefix("draft-") in ("none", "int8", "int4", "auto"):
                drafts = extra.removeprefix("draft-")
            else:
                raise ValueError(f"bench variant {spec!r}: '+{extra}' is none of '+vocabN', '+vocab-full', '+compile', "
                                 "'+draft-none|int8|int4|auto'")
        if head in ("int8", "int4"):
            return cls(spec, "bfloat16", head, vocab, compiled, drafts)
        if head not in dtypes:
            raise ValueError(f"bench variant {spec!r}: expected fp32, bf16, fp16, int8, int4 or auto, optionally "
                             "+vocabN, +compile, +draft-X")
        return cls(spec, dtypes[head], None, vocab, compiled, drafts)


@dataclass
class BenchConfig:
    """One configuration: `mtp` with `draft_tokens` (None = plain greedy) in a variant, or transformers' generate."""

    name: str
    engine: str  # "mtp" or "transformers"
    draft_tokens: int | str | None = None
    variant: Variant = field(default_factory=Variant)
    use_mtp: bool = False  # transformers only: its `generate(use_mtp=True)`

    @property
    def reference(self) -> str:
        """The configuration whose greedy output this one must reproduce (its variant's plain decoding)."""
        return plain_name(self.variant)


def plain_name(variant: Variant) -> str:
    return f"mtp {variant.name} plain" if variant.name else PLAIN


@dataclass
class Run:
    """One measured generation."""

    config: str
    prompt: int  # index in the prompt list
    repeat: int
    tokens: list[int]
    seconds: float
    peak_rss_mb: float
    stats: dict | None = None  # GenerationStats.as_dict() for mtp runs
    k_history: list[int] = field(default_factory=list)
    rss_before_mb: float | None = None  # resident set just before the run (peak - this = the run's working memory)


def configs_for(draft_tokens: list[int | str], with_transformers: bool,
                variants: list[Variant] | None = None, with_transformers_mtp: bool = False) -> list[BenchConfig]:
    """Per variant (the default first): plain, then one per draft setting; then transformers (when available), and
    its MTP decoding where the family has one."""
    out = []
    for v in variants or [Variant()]:
        label = f"mtp {v.name} " if v.name else "mtp "
        out.append(BenchConfig(plain_name(v), "mtp", None, v))
        out += [BenchConfig(f"{label}k={k}", "mtp", k, v) for k in draft_tokens]
    if with_transformers:
        out.append(BenchConfig(HF, "transformers"))
        if with_transformers_mtp:
            out.append(BenchConfig(HF_MTP, "transformers", use_mtp=True))
    return out


# ---------------------------------------------------------------------- memory
def _reset_peak_rss() -> bool:
    """Reset this process's VmHWM (Linux >= 4.0); False where not possible."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


def _status_mb(key: str) -> float | None:
    """A memory line of /proc/self/status (e.g. VmHWM, VmRSS) in MiB; None where there is none."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return None


def _peak_rss_mb() -> float:
    """Resident-set high-water mark in MiB: VmHWM (resettable) or ru_maxrss (process lifetime)."""
    hwm = _status_mb("VmHWM")
    return hwm if hwm is not None else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


# ---------------------------------------------------------------------- engines
def load_transformers(path: str | Path, dtype: torch.dtype, device: torch.device):
    """transformers' causal LM on the same folder (its AutoModelForCausalLM), or (None, reason) when this install
    or this family has none: the transformers column is a comparison, not part of `mtp`."""
    try:
        import transformers
        from transformers import AutoModelForCausalLM
    except ImportError as e:
        return None, f"transformers is not installed ({e})"
    transformers.logging.set_verbosity_error()  # it warns about the MTP tensors it does not use
    try:
        model = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype).to(device)
    except Exception as e:  # noqa: BLE001 - a family transformers cannot load becomes a note in the report
        return None, f"transformers could not load {path}: {type(e).__name__}: {e}"
    # transformers fills the fields a passed GenerationConfig leaves at their defaults from the folder's
    # generation_config.json (the shipped model's sets repetition_penalty 1.2 and EOS): the bench is pure greedy
    # to the length cap, like the mtp runs
    model.generation_config.repetition_penalty = 1.0
    model.generation_config.eos_token_id = None
    return model.eval(), None


def transformers_mtp_note(hf_model) -> str | None:
    """None when transformers can decode `hf_model` with its own MTP (`generate(use_mtp=True)`: its `MtpModel`
    finds the MTP tensors in the folder), else why not - a note in the report, not an error."""
    try:
        from transformers.modeling_layers import MtpModel
    except ImportError:
        return "this transformers has no MTP generation (transformers.modeling_layers.MtpModel)"
    if getattr(hf_model.config.get_text_config(), "num_mtp_layers", None) is None:
        return f"transformers has no MTP for {type(hf_model).__name__} (its config has no num_mtp_layers)"
    try:  # what generate(use_mtp=True) does first: load the MTP layers (it fails if the folder has none it knows)
        MtpModel.from_pretrained(hf_model, device_map={"": hf_model.device})
    except Exception as e:  # noqa: BLE001 - e.g. the MTP tensors at a layer index transformers does not look at
        return f"transformers cannot load the MTP of this folder: {type(e).__name__}: {str(e)[:200]}"
    return None


def make_generate_fn(models: dict, hf_model, cfg: BenchConfig, max_new_tokens: int, pad_token_id: int) -> Callable:
    """A function prompt_ids -> (new token ids, mtp stats or None, k history), greedy, EOS stops disabled.
    `models`: the loaded model of each variant's (dtype, quantize)."""
    if cfg.engine == "mtp":
        model = models[cfg.variant.model_key]
        vocab = (cfg.variant.draft_vocab or None) if cfg.draft_tokens else None

        def run_mtp(ids: list[int]):
            r = generate(model, ids, max_new_tokens=max_new_tokens, temperature=0.0, draft_tokens=cfg.draft_tokens,
                         eos_token_ids=[], draft_vocab=vocab, compile=cfg.variant.compiled)
            return r.tokens, r.stats.as_dict(), list(r.stats.k_history)
        return run_mtp

    from transformers import GenerationConfig

    # eos_token_id=None: run to max_new_tokens like the mtp runs. attention_mask and pad_token_id are passed
    # explicitly: otherwise transformers infers a padding mask from pad_token_id occurrences in the prompt.
    gen_config = GenerationConfig(max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=None,
                                  pad_token_id=pad_token_id, bos_token_id=None, repetition_penalty=1.0,
                                  **({"use_mtp": True} if cfg.use_mtp else {}))

    def run_hf(ids: list[int]):
        x = torch.tensor([ids], device=hf_model.device)
        with torch.inference_mode():
            out = hf_model.generate(x, attention_mask=torch.ones_like(x), generation_config=gen_config)
        return out[0, len(ids):].tolist(), None, []
    return run_hf


# ---------------------------------------------------------------------- the loop
def run_interleaved(models: dict, hf_model, configs: list[BenchConfig], prompts: list[Prompt], prompt_ids: list[list[int]],
                    max_new_tokens: int, repeats: int, pad_token_id: int, progress=None,
                    warmup_tokens: int = 8) -> tuple[list[Run], dict[str, str]]:
    """Warm every configuration up, then measure repeats x prompts x configs, interleaved. A compiled variant warms
    up on every prompt at full length, so that the graphs its runs use are compiled before they are timed.

    Returns the runs and {config name: error} for configurations that failed (they are left out of the
    measurement and the bench reports them as failures)."""
    failed: dict[str, str] = {}
    fns, warms = {}, {}
    for cfg in configs:
        fns[cfg.name] = make_generate_fn(models, hf_model, cfg, max_new_tokens, pad_token_id)
        compiled = cfg.engine == "mtp" and cfg.variant.compiled
        # (a compiled variant's short run could compile graphs of other shapes: it warms up at full length once)
        warms[cfg.name] = None if compiled else make_generate_fn(models, hf_model, cfg, warmup_tokens, pad_token_id)
        try:
            for ids in prompt_ids if compiled else prompt_ids[:1]:
                (warms[cfg.name] or fns[cfg.name])(ids)
        except Exception as e:  # noqa: BLE001 - reported as this configuration's failure, the others still run
            failed[cfg.name] = f"{type(e).__name__}: {e}"
    active = [c for c in configs if c.name not in failed]
    runs: list[Run] = []
    last = None
    for r in range(repeats):
        for p, ids in enumerate(prompt_ids):
            order = active if (r + p) % 2 == 0 else active[::-1]
            for cfg in order:
                if progress is not None:
                    progress.set_description(f"{cfg.name:>14} · prompt {p + 1}/{len(prompts)} · repeat {r + 1}/{repeats}")
                # the first run of a model after another model's read its prompt up to 2x slower (the caches held the
                # other's weights and buffers; 20-45 ms of int8's 13-50 ms prefills): plain and auto, at the ends of a
                # variant's configurations in the interleaving, carried it every time. An untimed short run first.
                if (cfg.engine, cfg.variant) != last and warms[cfg.name] is not None:
                    warms[cfg.name](ids)
                last = (cfg.engine, cfg.variant)
                _reset_peak_rss()
                before = _status_mb("VmRSS")
                # no garbage collection inside a timed run (as timeit): the bench's own heap (every run so far) made
                # a young-generation pass 60-70 ms, which landed on whichever run the allocation count chose
                gc.disable()
                try:
                    t0 = time.perf_counter()
                    tokens, stats, k_hist = fns[cfg.name](ids)
                    seconds = time.perf_counter() - t0
                finally:
                    gc.enable()
                runs.append(Run(cfg.name, p, r, tokens, seconds, _peak_rss_mb(), stats, k_hist, before))
                if progress is not None:
                    progress.update(1)
    return runs, failed


def check_identical(runs: list[Run], references: dict[str, str] | None = None) -> list[str]:
    """Every run's tokens must equal its reference configuration's for the same prompt (repeat 0): a variant's own
    plain decoding (`references`: config -> reference; default: mtp plain for all).

    Returns one message per mismatch (empty: all identical)."""
    references = references or {}
    repeat0 = {(r.config, r.prompt): r.tokens for r in runs if r.repeat == 0}
    problems = []
    for r in runs:
        reference = references.get(r.config, PLAIN)
        want = repeat0.get((reference, r.prompt))
        if want is None or r.tokens == want:
            continue
        first = next((i for i, (a, b) in enumerate(zip(r.tokens, want)) if a != b), min(len(r.tokens), len(want)))
        problems.append(f"{r.config} (prompt {r.prompt}, repeat {r.repeat}): differs from {reference} at new token "
                        f"{first}: {r.tokens[first:first + 5]} vs {want[first:first + 5]} "
                        f"(lengths {len(r.tokens)} vs {len(want)})")
    return problems
