"""Parity figures of DeepSeek-V3.2 / GLM-5 (issue 20) against transformers, on the tiny checkpoints the tests build
(`tests/test_families_dsa.py`): the largest absolute logit difference for prefill, for one-token decode forwards
after a 70-token prefill (eager rows and the compiled graph's masked form), and for MTP depths 1 and 2 against the
MTP layer's equations over transformers' decoder layer. The tests assert 1e-4; this prints what is reached.

    python scripts/dsa_parity.py
"""

from __future__ import annotations

import sys
import tempfile
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
import test_families_dsa as T  # noqa: E402
from mtp.io import read_tensors  # noqa: E402


@torch.no_grad()
def mtp_errors(name: str, ref: T.Reference, ours) -> list[float]:
    """Max abs difference of our MTP logits (depths 1, 2) from the equations over transformers' decoder layer."""
    fam = T.FAMILIES[name]
    L, eps = fam.kw["num_hidden_layers"], ref.config.rms_norm_eps
    with read_tensors(ref.path) as t:
        sd = {k: t.tensor(k).clone() for k in t}
    p = f"model.layers.{L}."
    ids = torch.randint(0, 64, (1, 30), generator=torch.Generator().manual_seed(3))
    got, prev, errs = ours.mtp_logits(ids, 2), ref.hf.model(ids).last_hidden_state[0], []
    for d in (1, 2):
        n = ids.shape[1] - d
        e = sd[p + "embed_tokens.weight"][ids[0, d:]]
        x = torch.cat([T.rms(e, sd[p + "enorm.weight"], eps), T.rms(prev[:n], sd[p + "hnorm.weight"], eps)], -1) \
            @ sd[p + "eh_proj.weight"].T
        causal = torch.ones(n, n, dtype=torch.bool).tril()[None, None]
        out = ref.mtp_layer(x[None], attention_mask=causal, position_embeddings=ref.rotary(x[None], torch.arange(n)[None]),
                            position_ids=torch.arange(n)[None])
        out = out[0] if isinstance(out, tuple) else out
        prev = T.rms(out[0], sd[p + "shared_head.norm.weight"], eps)
        errs.append((got[d - 1][0] - prev @ sd[p + "shared_head.head.weight"].T).abs().max().item())
    return errs


@torch.no_grad()
def main() -> None:
    torch.set_num_threads(1)
    warnings.simplefilter("ignore")
    for name, fam in T.FAMILIES.items():
        ref = T.build_reference(fam, Path(tempfile.mkdtemp()))
        ours = T.load(ref.path)
        ids = torch.randint(0, 64, (2, 90), generator=torch.Generator().manual_seed(1))
        want = ref.hf(ids).logits
        prefill = (ours(ids) - want).abs().max().item()
        decode = max((T.decode_steps(ours, ids, 70, eager) - want[:, 70:]).abs().max().item() for eager in (True, False))
        line = f"{name:12s} index_topk={fam.kw['index_topk']:3d}  prefill {prefill:.1e}  decode {decode:.1e}"
        if name in T.MAIN:
            line += "  MTP depth 1 / 2 " + " / ".join(f"{e:.1e}" for e in mtp_errors(name, ref, ours))
        print(line, flush=True)


if __name__ == "__main__":
    main()
