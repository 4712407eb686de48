"""Prefill: the backbone reads a prompt in chunks of PREFILL_CHUNK tokens.

Every decoding path (plain, speculative, the batched server) reads prompts with the same chunks, so a request's
prefill computes exactly the same numbers whether it is served alone or interleaved with other requests' decoding;
chunks also bound the memory a long prompt needs."""

from __future__ import annotations

import torch

from ..model.linear import prompt_products

# 256: a layer's weights stream from L3 once per chunk, and the products of 128 rows waited on that stream (the 7 bench
# prompts read 12% faster than in 128-token chunks, AMX Xeon; a newcomer's chunk holds the batch ~40 ms instead of ~20)
PREFILL_CHUNK = 256


def prefill_chunk(model, ids: list[int], cache, lo: int) -> torch.Tensor:
    """Read ids[lo : lo + PREFILL_CHUNK] into `cache` (a single sequence at position lo): hidden [1, n, H]. int8/int4
    layers multiply a chunk's rows on the bf16 tiles (`prompt_products`)."""
    x = torch.tensor([ids[lo : lo + PREFILL_CHUNK]], device=model.device)
    with prompt_products():
        return model.hidden(x, cache)


def prefill(model, ids: list[int], cache) -> torch.Tensor:
    """Read a whole prompt into an empty single-sequence cache: hidden [1, P, H]."""
    parts = [prefill_chunk(model, ids, cache, lo) for lo in range(0, len(ids), PREFILL_CHUNK)]
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)
