"""Check `mtp export --to speculators` with speculators' own reader (src/mtp/export.py).

speculators pins an older transformers than mtp's, so it lives in its own environment, named by --python:
    python3 -m venv /tmp/specvenv && /tmp/specvenv/bin/pip install torch==2.13.0 && \
        /tmp/specvenv/bin/pip install --no-deps speculators==0.9.0 && /tmp/specvenv/bin/pip install <its other deps>
    python scripts/speculators_check.py --python /tmp/specvenv/bin/python

Here (mtp's environment), for each case - the shipped model (Qwen3.5, native `mtp.*`), a random Qwen3.5-MoE and
Qwen3-Next, and a random transformers Qwen3 with a `mtp retrofit --style head` layer - the model is saved, exported
in fp32, and our depth-1 MTP logits are computed on random ids from the backbone's hidden states. Then, in the speculators
environment, `MTPDraftModel.from_pretrained(export)` (embedding and head from the verifier folder named in the
export's config) runs its first speculative step on the same ids and hidden states; the script prints the largest
difference from our logits per case. For the native layouts it also runs speculators' `MTPConverter` on the saved
model and compares its tensors with our export, name by name (equal bits expected).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

READER = r"""
import json, sys, torch
from speculators.models.mtp import MTPDraftModel
from speculators.convert.mtp.converter import MTPConverter
from safetensors.torch import load_file
out = {}
for case in json.loads(sys.argv[1]):
    ref = torch.load(case["ref"])
    draft = MTPDraftModel.from_pretrained(case["export"]).float().eval()
    with torch.no_grad():
        logits, _, _ = draft(input_ids=ref["ids"], hidden_states=ref["hidden"])
    got = logits[0]                                      # step 0: h_i, embed(t_{i+1}) -> t_{i+2}
    want = ref["logits"][:, : got.shape[1]]
    r = {"positions": got.shape[1], "max_abs_diff": (got - want).abs().max().item(),
         "argmax_equal": bool((got.argmax(-1) == want.argmax(-1)).all())}
    if case["native"]:
        theirs = MTPConverter().convert_to_state_dict(case["model"])
        ours = load_file(case["export_stored"] + "/model.safetensors")
        r["converter_names_equal"] = sorted(theirs) == sorted(ours)
        r["converter_tensors_equal"] = r["converter_names_equal"] and all(torch.equal(theirs[k], ours[k]) for k in ours)
    out[case["name"]] = r
print(json.dumps(out))
"""


def cases(work: Path) -> list[dict]:
    import torch
    import transformers

    import mtp
    from mtp.export import export_speculators

    sys.path.insert(0, str(ROOT / "tests"))
    from conftest import tiny_model
    from test_qwen3_next import build_reference

    qwen3 = dict(vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16, max_position_embeddings=256)
    built = {}
    built["qwen3_5 (shipped code-small)"] = (ROOT / "models" / "code-small", True)
    moe = work / "qwen3_5_moe"
    mtp.save_model(tiny_model(seed=1, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=16,
                              shared_expert_intermediate_size=24), moe)
    built["qwen3_5_moe (random)"] = (moe, True)
    nxt = work / "qwen3_next"
    nxt.mkdir()
    build_reference(nxt)
    built["qwen3_next (random)"] = (nxt, True)
    q3 = work / "qwen3"
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(transformers.Qwen3Config(**qwen3)).save_pretrained(q3)
    model = mtp.load_model(q3, dtype="float32")  # the generic family (model/hf_causal.py) + a fresh MTP layer,
    model.config.mtp_num_hidden_layers = 1         # as `mtp retrofit --style head --layers 1` starts
    model.mtp = model.new_mtp_module()
    model.init_weights(modules=model.mtp)
    with torch.no_grad():  # norms away from 1, so a swapped norm shows
        for name, p in model.mtp.named_parameters():
            if name.endswith("norm.weight"):
                p.add_(0.1 * torch.randn_like(p))
    retro = work / "qwen3_retrofit"
    mtp.save_model(model, retro)
    built["qwen3 + retrofit head (random)"] = (retro, False)

    out = []
    for i, (name, (path, native)) in enumerate(built.items()):
        export = work / f"export{i}"
        export_speculators(path, export, dtype="float32")
        stored = work / f"export{i}_stored"
        export_speculators(path, stored)
        model = mtp.load_model(path, dtype="float32").eval()
        g = torch.Generator().manual_seed(i)
        ids = torch.randint(0, model.config.vocab_size, (1, 48), generator=g)
        with torch.no_grad():
            hidden = model.hidden(ids)
            hd = next(iter(model.mtp_hidden_states(ids, 1, hidden=hidden)))
            logits = model.mtp_head(hd, 1)
        ref = work / f"ref{i}.pt"
        torch.save({"ids": ids, "hidden": hidden, "logits": logits}, ref)
        out.append({"name": name, "model": str(path), "export": str(export), "export_stored": str(stored),
                    "ref": str(ref), "native": native})
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--python", required=True, help="a Python with speculators 0.9 installed")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        todo = cases(Path(tmp))
        run = subprocess.run([args.python, "-c", READER, json.dumps(todo)], capture_output=True, text=True)
        if run.returncode:
            print(run.stderr[-4000:], file=sys.stderr)
            return run.returncode
        result = json.loads(run.stdout.strip().splitlines()[-1])
    print(json.dumps(result, indent=1))
    ok = all(r["argmax_equal"] and r["max_abs_diff"] < 1e-4 and r.get("converter_tensors_equal", True)
             for r in result.values())
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
