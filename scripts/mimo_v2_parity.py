"""Parity figures of MiMo-V2-Flash (issue 20) against transformers, on the tiny checkpoints the tests build
(`tests/test_mimo_v2.py`: 4 layers global/sliding/sliding/global, a window of 5, 2 x 40 tokens): the largest absolute
logit difference for prefill, for a cached prefill in chunks then one-token steps, for decode forwards (widths 12, 1,
4, 23 at positions in tensors; eager rows and the compiled graph's masked form), and for MTP depths 1..3 against the
equations over transformers' decoder layers. The tests assert 1e-4; this prints what is reached.

    python scripts/mimo_v2_parity.py
"""

from __future__ import annotations

import sys
import tempfile
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
import test_mimo_v2 as T  # noqa: E402


@torch.no_grad()
def main() -> None:
    torch.set_num_threads(1)
    for name, over in T.VARIANTS.items():
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            ref = T.build_reference(Path(tempfile.mkdtemp()), **over)
        ours = T.load(ref.path)
        ids = torch.randint(0, 64, (2, 40), generator=torch.Generator().manual_seed(1))
        want = ref.hf(ids).logits
        err = lambda x, want=want: float((x - want).abs().max())  # noqa: E731
        cache = ours.new_cache(2, 64)
        cached = torch.cat([ours(ids[:, :17], cache), ours(ids[:, 17:23], cache)]
                           + [ours(ids[:, i : i + 1], cache) for i in range(23, 40)], 1)
        decode = {}
        for eager in (True, False):
            cache = ours.new_cache(2, 64, rows=True)
            ours.prepare_decode(64)
            got = []
            for a, b in ((0, 12), (12, 13), (13, 17), (17, 40)):
                index = torch.arange(a, b)[None].expand(2, -1)
                h, _ = ours.decode(ids[:, a:b], cache, ours.decode_positions(index, [a, a] if eager else None))
                got.append(ours.head(h))
            decode[eager] = err(torch.cat(got, 1))
        mids = torch.randint(0, 64, (1, 20), generator=torch.Generator().manual_seed(2))
        mtp_err = [float((g[0] - w).abs().max()) for g, w in zip(ours.mtp_logits(mids, T.N_MTP), T.reference_mtp_logits(ref, mids))]
        print(f"{name}: backbone prefill {err(ours(ids)):.1e}, cached {err(cached):.1e}, decode eager {decode[True]:.1e}, "
              f"masked {decode[False]:.1e} (max |logit| {float(want.abs().max()):.1f}); MTP depth 1/2/3 "
              + " / ".join(f"{e:.1e}" for e in mtp_err))


if __name__ == "__main__":
    main()
