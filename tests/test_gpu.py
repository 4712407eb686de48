"""GPU checks (skipped without CUDA): lossless speculative decoding, one training step and one served request on
the GPU. On a machine with a GPU: `python -m pytest tests/test_gpu.py` (README, "GPU")."""

from __future__ import annotations

import httpx
import pytest
import torch

import mtp
from conftest import assert_greedy_agrees, trained_tiny_model
from serve_support import ServerProcess, build_model_dir
from test_data import build_toy

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def test_greedy_speculative_equals_plain_on_gpu():
    model = trained_tiny_model(depth=3).to("cuda")
    assert model.device.type == "cuda"
    g = torch.Generator().manual_seed(0)
    for _ in range(4):
        prompt = torch.randint(0, model.config.vocab_size, (12,), generator=g).tolist()
        want = mtp.generate(model, prompt, max_new_tokens=40).tokens
        for k in (1, 2, 3, 4, "auto"):
            r = mtp.generate(model, prompt, max_new_tokens=40, draft_tokens=k)
            assert r.tokens == want, k


def test_captured_rounds_on_gpu_equal_eager():
    """CUDA graphs (torch.compile mode="reduce-overhead"): captured speculative == captured plain, which agrees with
    eager plain (up to a near-tie: fused kernels may round the last bit differently)."""
    model = trained_tiny_model(depth=3).to("cuda")
    prompt = [i % (model.config.vocab_size - 1) + 1 for i in range(12)]  # the tiny model's vocabulary is 8
    want = mtp.generate(model, prompt, max_new_tokens=32).tokens
    plain = mtp.generate(model, prompt, max_new_tokens=32, compile=True).tokens
    assert_greedy_agrees(model, prompt, plain, want)
    for k in (2, 3):
        assert mtp.generate(model, prompt, max_new_tokens=32, draft_tokens=k, compile=True).tokens == plain, k


def test_sampling_on_gpu_is_reproducible_with_a_seed():
    model = trained_tiny_model(depth=2).to("cuda")
    a = mtp.generate(model, [1, 2, 3], max_new_tokens=20, temperature=0.8, seed=7, draft_tokens=3).tokens
    b = mtp.generate(model, [1, 2, 3], max_new_tokens=20, temperature=0.8, seed=7, draft_tokens=3).tokens
    assert a == b


def test_one_training_step_on_gpu(tmp_path):
    from mtp.train.config import TrainConfig
    from mtp.train.trainer import train

    data = build_toy(tmp_path / "data")
    model = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, full_attention_interval=2,
                 num_attention_heads=2, num_key_value_heads=1, head_dim=16, linear_num_key_heads=2,
                 linear_num_value_heads=2, linear_key_head_dim=8, linear_value_head_dim=8,
                 max_position_embeddings=256, rope_theta=10000.0, mtp_num_hidden_layers=1)
    cfg = TrainConfig(data=str(data), out=str(tmp_path / "run"), model=model, seq_len=32, micro_batch=4, max_steps=2,
                      eval_every=2, save_every=2, eval_seqs=8, eval_batch=4, progress=False, device="cuda", bf16=True)
    val = train(cfg)
    assert val["loss"] == val["loss"] and val["loss"] < 20  # finite
    assert mtp.load_model(tmp_path / "run" / "model").has_mtp


def test_served_request_on_gpu(tmp_path):
    model_dir = build_model_dir(tmp_path / "m", chat_template=False)
    server = ServerProcess(model_dir, tmp_path / "log.txt", "--device", "cuda")
    try:
        body = {"model": "m", "prompt": "def add(", "max_tokens": 12, "temperature": 0}
        r = httpx.post(server.url + "/v1/completions", json=body, timeout=60)
        assert r.status_code == 200, r.text
        ref = mtp.generate(mtp.load_model(model_dir, device="cuda"), mtp.load_model(model_dir).tokenizer.encode("def add("),
                           max_new_tokens=12)
        assert r.json()["choices"][0]["text"] == ref.text.removesuffix("<|endoftext|>")
    finally:
        server.stop()
