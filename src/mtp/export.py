"""`mtp export MODEL OUT --to speculators`: a model's MTP module written as another engine's draft model.

`speculators` (the draft-model format vLLM reads: `config.json` with `speculators_model_type`, the draft's own
weights, the verifier named in `speculators_config.verifier`) has an MTP draft type, `MTPDraftModel`: one MTP layer
    x = input_proj(cat[token_layernorm(embed(t_{i+1})), hidden_layernorm(h_i)])    (embedding first)
    h' = final_layernorm(decoder_layer(x))      -> logits by the verifier's lm_head
which is the computation of Qwen3.5's `mtp.*` and of the next-n layer `mtp retrofit --style head` adds to a
transformers Qwen3 (`model/hf_causal.py`), so exporting is renaming the MTP's tensors. The embedding and the head are
not written: the reader takes them from the verifier (`speculators_config.verifier.name_or_path`, by default the
model folder given). speculators 0.9 builds the draft layer from `transformer_layer_config.model_type` for four
types (`SPECULATORS_RENAMES`) and one MTP layer; every other model is refused with the reason. The layout was read
from speculators 0.9.0's converter and model (docs/decisions.md, "export to speculators"); `scripts/speculators_check.py`
loads an export with speculators' own `MTPDraftModel` and compares its logits with ours.

The write is atomic (`io.files.FolderWriter`): a failed export leaves OUT as it was.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from .config import ConfigError

FORMATS = ("speculators",)
SPECULATORS_VERSION = "0.9.0"  # the version whose layout is written (and checked by scripts/speculators_check.py)

# Qwen3.5's / Qwen3-Next's native MTP names (checkpoint names, `mtp.*`) -> speculators' `mtp_layers.0.*`, as
# speculators' own converter renames them.
_NATIVE = (("mtp.fc.", "input_proj."), ("mtp.norm.", "final_layernorm."),
           ("mtp.pre_fc_norm_hidden.", "hidden_layernorm."), ("mtp.pre_fc_norm_embedding.", "token_layernorm."),
           ("mtp.layers.0.", ""))
# the next-n layer of `model/hf_causal.py` (DeepSeek-V3's names inside `mtp.layers.0`)
_NEXTN = (("mtp.layers.0.eh_proj.", "input_proj."), ("mtp.layers.0.enorm.", "token_layernorm."),
          ("mtp.layers.0.hnorm.", "hidden_layernorm."), ("mtp.layers.0.shared_head.norm.", "final_layernorm."),
          ("mtp.layers.0.", ""))
SPECULATORS_RENAMES: dict[str, tuple[tuple[str, str], ...]] = {
    "qwen3_5_text": _NATIVE, "qwen3_5_moe_text": _NATIVE, "qwen3_next": _NATIVE, "qwen3": _NEXTN}


def speculators_name(name: str, renames: tuple[tuple[str, str], ...]) -> str:
    """A checkpoint name of the MTP (`mtp.*`) -> speculators' (`mtp_layers.0.*`); the first matching prefix wins."""
    for old, new in renames:
        if name.startswith(old):
            return "mtp_layers.0." + new + name[len(old):]
    raise ConfigError(f"tensor {name!r} is not part of one MTP layer that speculators' MTPDraftModel holds")


def speculators_config(text: dict, verifier: str, architectures: list[str], draft_tokens: int, dtype: str) -> dict:
    """The draft's config.json: `text` (the verifier's text config, HF keys) as the layer config, one greedy
    proposal method of `draft_tokens`, the verifier by name or path."""
    return {
        "architectures": ["MTPDraftModel"],
        "speculators_model_type": "mtp",
        "speculators_version": SPECULATORS_VERSION,
        "num_nextn_predict_layers": 1,
        "dtype": dtype,
        "transformer_layer_config": text,
        "speculators_config": {
            "algorithm": "mtp",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": draft_tokens,
                                  "verifier_accept_k": 1, "accept_tolerance": 0.0}],
            "default_proposal_method": "greedy",
            "verifier": {"name_or_path": verifier, "architectures": architectures},
        },
    }


def check_exportable(config, model_path: str | Path) -> dict:
    """The config's text part with HF keys (the draft layer's config) if speculators has a draft type for it and it
    declares one MTP layer; else ConfigError naming the rule."""
    text = config.to_hf_dict()
    for key in ("architectures", "dtype", "torch_dtype"):
        text.pop(key, None)
    if text["model_type"] not in SPECULATORS_RENAMES:
        raise ConfigError(
            f"{model_path}: model_type {text['model_type']!r} has no MTP draft type in speculators "
            f"{SPECULATORS_VERSION} (it builds the draft layer for {', '.join(sorted(SPECULATORS_RENAMES))}); "
            "mtp loads this model's MTP in its own layout")
    if config.mtp_num_hidden_layers == 0:
        raise ConfigError(f"{model_path}: {config.mtp_layers_key}=0: the model has no MTP to export "
                          "(`mtp retrofit --style head` adds one)")
    if config.mtp_num_hidden_layers != 1:
        raise ConfigError(f"{model_path}: {config.mtp_layers_key}={config.mtp_num_hidden_layers}; speculators' "
                          "MTPDraftModel holds exactly one MTP layer")
    return text


def export_speculators(model_path: str | Path, out: str | Path, verifier: str | None = None,
                       draft_tokens: int = 3, dtype: str | None = None) -> dict:
    """Write the MTP of the model at `model_path` as a speculators MTP draft in folder `out`; returns its config.
    The model type and the MTP layer count are checked on config.json before any weight is read; the model is then
    loaded whole (`load_model`: its checks, any quantized format decoded, experts fused) and only `mtp.*` written."""
    from .io.files import FolderWriter, save_tensors
    from .io.safetensors_mmap import CheckpointError
    from .model import config_from_json, load_model

    if draft_tokens < 1:
        raise ConfigError(f"--draft-tokens must be >= 1, got {draft_tokens}")
    config_json = Path(model_path) / "config.json"
    if not config_json.is_file():
        raise CheckpointError(f"{model_path}: no config.json (not a checkpoint folder)")
    text = check_exportable(config_from_json(config_json).text_only(), model_path)
    model = load_model(model_path, dtype=dtype or "auto")
    config = model.config.text_only()
    if model.mtp is None:
        raise ConfigError(f"{model_path}: the checkpoint has no MTP weights to export (`mtp check` says more)")
    renames = SPECULATORS_RENAMES[text["model_type"]]
    # the parameters under the checkpoint's names with routed experts fused ([E, 2I, H] gate rows first, and
    # [E, H, I]), the layout speculators' MTPDraftModel holds whatever layout the checkpoint was stored in
    state = {name: v for k, v in model.state_dict().items()
             if model.is_mtp_tensor(name := model.checkpoint_name(k, model.config), config)}
    draft = {speculators_name(k, renames): v.contiguous() for k, v in state.items()}  # load_model cast to `dtype`
    saved = next(v.dtype for v in draft.values() if v.is_floating_point())
    name = verifier if verifier is not None else str(Path(model_path).resolve())
    out_config = speculators_config(text, name, [config.architecture], draft_tokens,
                                    str(saved).removeprefix("torch."))
    Path(out).mkdir(parents=True, exist_ok=True)
    with FolderWriter(out) as w:
        save_tensors(draft, w)
        w.write_text("config.json", json.dumps(out_config, indent=2, sort_keys=True) + "\n")
    return out_config


def register(sub) -> None:
    p = sub.add_parser("export", help="write a model's MTP as another engine's draft model (vLLM's speculators "
                                      "MTP format)",
                       description="Write the MTP module of MODEL as a draft model in another format. "
                                   "speculators: the MTPDraftModel layout vLLM reads, for Qwen3.5 (dense and MoE), "
                                   "Qwen3-Next and a transformers Qwen3 with a `mtp retrofit --style head` layer; "
                                   "the draft's embedding and head come from the verifier.")
    p.add_argument("model", help="an mtp checkpoint folder with one MTP layer")
    p.add_argument("out", help="output folder (written atomically)")
    p.add_argument("--to", choices=FORMATS, default="speculators", help="the format (default: speculators)")
    p.add_argument("--verifier", default=None,
                   help="the verifier's Hugging Face id or path written into the draft's config (default: MODEL's "
                        "absolute path)")
    p.add_argument("--draft-tokens", type=int, default=3, help="speculative tokens of the proposal method (default 3)")
    p.add_argument("--dtype", default=None, help="cast the draft's tensors (default: as stored)")
    p.set_defaults(func=cmd_export)


def cmd_export(args: argparse.Namespace) -> int:
    cfg = export_speculators(args.model, args.out, args.verifier, args.draft_tokens, args.dtype)
    print(json.dumps({"out": str(args.out), "format": args.to, "draft_tokens": args.draft_tokens,
                      "transformer_layer_config.model_type": cfg["transformer_layer_config"]["model_type"],
                      "verifier": cfg["speculators_config"]["verifier"]["name_or_path"]}))
    return 0
