"""Tiny models built in code: every test runs on 2 CPU cores in seconds."""

from __future__ import annotations

import pytest
import torch

from mtp import Qwen35Config, Qwen35ForCausalLM
from mtp.model import init_weights_


def tiny_config(**overrides) -> Qwen35Config:
    base = dict(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=8,
        linear_conv_kernel_dim=4, full_attention_interval=2, max_position_embeddings=512,
        tie_word_embeddings=True, mtp_num_hidden_layers=1, rope_theta=10000.0, partial_rotary_factor=0.5,
    )
    base.update(overrides)
    return Qwen35Config(**base)


def tiny_model(seed: int = 0, std: float = 0.2, **overrides) -> Qwen35ForCausalLM:
    """A random tiny model; a large init std makes its outputs peaked (and sensitive to bugs)."""
    model = Qwen35ForCausalLM(tiny_config(**overrides))
    init_weights_(model, std=std, seed=seed)
    # Randomise the norms too so that a missing (1 + w) or a swapped norm shows up in parity tests.
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or "layernorm" in name or "pre_fc_norm" in name:
                p.add_(0.1 * torch.randn(p.shape, generator=g))
    return model.eval()


@pytest.fixture
def make_tiny():
    return tiny_model
