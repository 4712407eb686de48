"""`mtp check MODEL`: what a checkpoint is, and whether its MTP head can draft.

Reports the family and checkpoint layout (expert layouts, multimodal nesting, quantization), the MTP layers the
config declares against those the tensors hold, each tensor group's stored dtypes, and a quick probe: the
first-draft agreement of the MTP with the backbone, teacher-forced over a few built-in prompts - at position i the
MTP's depth-1 guess for token i+2 against the backbone's own greedy choice for it (computed at i+1). A trained head
agrees most of the time (real releases 0.6-0.9); a random one about 1/vocab; a zeroed one gives constant logits.

Verdicts: "ok" (exit 0); "missing" (config declares MTP layers, the checkpoint holds none: `mtp heal`), "incomplete"
(some MTP tensors missing: the checkpoint does not load), "zeroed" (every MTP weight zero), "untrained" (agreement
below `MIN_AGREEMENT`), "none" (the config declares no MTP) - all exit 1; `--json` prints the report as one object.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter
from pathlib import Path

import torch

from .cli_common import add_model_args, load_from_args, model_name
from .io.files import TensorIndex
from .io.hub import resolve_checkpoint
from .io.safetensors_mmap import CheckpointError
from .model.base import MTP_LAYER
from .model.families import config_from_json, model_class_for
from .model.linear import FastLinear

# Below this first-draft agreement a head is reported untrained (a random head sits near 1/vocab; a trained one, on
# text it was trained for, far above).
MIN_AGREEMENT = 0.2
PROMPTS = Path(__file__).parent / "assets" / "bench_prompts.jsonl"
ADVICE = {
    "missing": "restore the MTP layers from the base checkpoint this model was fine-tuned from: mtp heal --base BASE "
               "--finetuned MODEL --out DIR",
    "incomplete": "the checkpoint lacks some MTP tensors: graft the MTP layers whole from the base with mtp heal",
    "zeroed": "the MTP weights are all zero: graft them from the base with mtp heal, or train them (mtp train "
              "mode=heads init=MODEL data=DIR out=DIR)",
    "untrained": "the MTP head barely agrees with the backbone: train it (mtp train mode=heads init=MODEL data=DIR "
                 "out=DIR) or graft it from the base with mtp heal",
    "none": "the config declares no MTP layers: speculative decoding falls back to plain decoding",
}


def group_of(cls, name: str, config) -> str:
    """A checkpoint tensor's group: mtp, embed, head, backbone (or other: not part of the model)."""
    ours = cls.internal_name(name, config)
    if ours is None:
        return "other"
    if ours.startswith("mtp."):
        return "mtp"
    if "embed_tokens" in ours:
        return "embed"
    if ours.startswith("lm_head"):
        return "head"
    return "backbone"


def describe(path: Path) -> dict:
    """Everything `check` reports that the headers tell (no weights read)."""
    config = config_from_json(path / "config.json")
    cls = model_class_for(config)
    qc = config.quantization_config
    with TensorIndex(path) as files:
        names = list(files)
        dtypes: dict[str, Counter] = {}
        for name in names:
            st, key = files[name]
            dtypes.setdefault(group_of(cls, name, config), Counter())[str(st.dtype(key)).removeprefix("torch.")] += 1
        mtp_found = sorted({int(m[1]) for n in names if cls.is_mtp_tensor(n, config)
                            and (m := MTP_LAYER.match(cls.internal_name(n, config) or ""))})
    return {
        "model": str(path), "family": config.model_types[0], "architecture": cls.__name__,
        "multimodal_nesting": config.outer is not None,
        "quantization": None if qc is None else {k: qc.get(k) for k in ("quant_method", "format", "bits", "group_size",
                                                                         "weight_block_size", "modules_to_not_convert")
                                                 if qc.get(k) is not None},
        "mtp_expected": config.mtp_num_hidden_layers, "mtp_found": len(mtp_found), "mtp_layers_key": config.mtp_layers_key,
        "tensor_dtypes": {g: dict(c) for g, c in sorted(dtypes.items())},
    }


def prompts_for(model, n: int = 4, length: int = 96) -> list[list[int]]:
    """Token ids of the built-in prompts (the shipped bench prompts) when the model has a tokenizer; otherwise
    sequences repeating a short motif, which any trained language model continues (deterministic)."""
    if model.tokenizer is not None:
        texts = [json.loads(line)["text"] for line in PROMPTS.read_text().splitlines()[:n]]
        return [model.tokenizer.encode(t)[:length] for t in texts]
    g = torch.Generator().manual_seed(0)
    out = []
    for i in range(n):
        motif = torch.randint(0, model.config.vocab_size, (2 + i,), generator=g)
        out.append(motif.repeat(length // len(motif) + 1)[:length].tolist())
    return out


@torch.no_grad()
def agreement(model, prompts: list[list[int]]) -> float:
    """Mean over prompts and positions of [argmax MTP depth-1 at i == argmax backbone at i+1] (teacher-forced)."""
    hits = total = 0
    for ids in prompts:
        x = torch.tensor([ids], device=model.device)
        h = model.hidden(x)
        backbone = model.head(h).argmax(-1)[0]  # [T]: position j predicts token j+1
        draft = model.mtp_head(next(iter(model.mtp_hidden_states(x, 1, hidden=h))), 1).argmax(-1)[0]  # i: token i+2
        n = min(len(draft), len(backbone) - 1)
        hits += int((draft[:n] == backbone[1 : n + 1]).sum())
        total += n
    return hits / max(total, 1)


def all_zero(module: torch.nn.Module) -> bool:
    """Are all of the module's weight matrices zero? A quantized layer that let go of its float weight (`mtp check
    --quantize` loads so) is probed through its codes: it multiplies the identity, 256 rows at a time."""
    with torch.no_grad():
        for m in module.modules():
            if isinstance(m, FastLinear) and m.released:
                eye = torch.eye(m.in_features, dtype=torch.bfloat16)
                for i in range(0, m.in_features, 256):
                    if m.run(eye[i : i + 256]).any():
                        return False
        return all(not p.any() for p in module.parameters() if p.dim() >= 2 and not p.is_meta)


def check(args) -> dict:
    path = resolve_checkpoint(model_name(args), revision=args.revision)
    report = describe(path)
    if report["mtp_expected"] == 0:
        report["verdict"] = "none"
    elif report["mtp_found"] == 0:
        report["verdict"] = "missing"
    else:
        try:
            model = load_from_args(args)
        except CheckpointError as e:
            report.update(verdict="incomplete", error=str(e))
            return report
        if all_zero(model.mtp):
            report["verdict"] = "zeroed"
        else:
            report["first_draft_agreement"] = round(agreement(model, prompts_for(model)), 4)
            report["verdict"] = "ok" if report["first_draft_agreement"] >= MIN_AGREEMENT else "untrained"
    if report["verdict"] != "ok":
        report["advice"] = ADVICE[report["verdict"]]
    return report


def print_report(r: dict, out=sys.stdout) -> None:
    q = r["quantization"]
    print(f"model        {r['model']}", file=out)
    print(f"family       {r['family']} ({r['architecture']}{', multimodal file' if r['multimodal_nesting'] else ''})", file=out)
    print(f"quantization {'none (float)' if q is None else ', '.join(f'{k} {v}' for k, v in q.items())}", file=out)
    print(f"MTP layers   expected {r['mtp_expected']} ({r['mtp_layers_key']}), found {r['mtp_found']}", file=out)
    for group, counts in r["tensor_dtypes"].items():
        print(f"  {group:9s}  " + ", ".join(f"{n} {dt}" for dt, n in counts.items()), file=out)
    if "first_draft_agreement" in r:
        print(f"first-draft agreement with the backbone: {r['first_draft_agreement']:.2f}", file=out)
    if "error" in r:
        print(f"load error: {r['error']}", file=out)
    print(f"verdict      {r['verdict']}" + (f": {r['advice']}" if "advice" in r else ""), file=out)


def cmd_check(args) -> int:
    report = check(args)
    if args.json:
        print(json.dumps(report))
    else:
        print_report(report)
    return 0 if report["verdict"] == "ok" else 1


def register(subparsers) -> None:
    p = subparsers.add_parser("check", help="what a checkpoint is and whether its MTP head is present, complete and trained",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model_path", nargs="?", default=None, help="checkpoint folder or hub id (or --model)")
    add_model_args(p)
    p.add_argument("--json", action="store_true", help="print the report as one JSON object")
    p.set_defaults(func=lambda a: cmd_check(_positional(a)))


def _positional(args):
    if args.model_path is not None:
        args.model = args.model_path
    return args
