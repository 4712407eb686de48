"""`mtp export --to speculators` (src/mtp/export.py): the MTP written as speculators' `MTPDraftModel` checkpoint.

speculators itself pins an older transformers and is not installed here; `scripts/speculators_check.py` loads the
exports with it (docs/decisions.md, "export to speculators"). These tests hold the layout to what that reader
computes: the draft is rebuilt the way `MTPDraftModel` builds it (transformers' decoder layer of
`transformer_layer_config.model_type`, layer index of the last full-attention layer, the `mtp_layers.0.*` norms and
`input_proj`, embedding and head from the verifier) and its first-step logits must equal our depth-1 MTP logits."""

from __future__ import annotations

import copy
import json
import subprocess
import sys

import pytest
import torch
from torch import nn

import mtp
from conftest import tiny_model
from mtp.config import ConfigError
from mtp.export import export_speculators
from mtp.io import read_tensors
from test_qwen3_next import build_reference

transformers = pytest.importorskip("transformers")

QWEN3 = dict(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
             num_key_value_heads=1, head_dim=16, max_position_embeddings=128)


def transformers_base(tmp_path, arch: str = "Qwen3Config"):
    torch.manual_seed(0)
    path = tmp_path / arch
    transformers.AutoModelForCausalLM.from_config(getattr(transformers, arch)(**QWEN3)).save_pretrained(path)
    return path


def retrofitted(tmp_path, layers: int = 1, arch: str = "Qwen3Config"):
    """A transformers model with fresh (random) MTP layers, as `mtp retrofit --style head` starts, saved by mtp."""
    model = mtp.load_model(transformers_base(tmp_path, arch), dtype="float32")
    model.config.mtp_num_hidden_layers = layers
    model.mtp = model.new_mtp_module()
    model.init_weights(modules=model.mtp)
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():  # norms away from 1: a swapped or dropped norm changes the logits
        for name, p in model.mtp.named_parameters():
            if name.endswith("norm.weight"):
                p.add_(0.2 * torch.randn(p.shape, generator=g))
    path = tmp_path / f"retrofit{layers}"
    mtp.save_model(model, path)
    return path


class SpeculatorsMTPLayer(nn.Module):
    """speculators' MTP layer (its MTPLayerMixin over transformers' decoder layer), rebuilt from its published code."""

    def __init__(self, config, decoder_cls, norm_cls, layer_idx: int):
        super().__init__()
        H, eps = config.hidden_size, config.rms_norm_eps
        self.layer = decoder_cls(config, layer_idx)
        self.hidden_layernorm, self.token_layernorm = norm_cls(H, eps=eps), norm_cls(H, eps=eps)
        self.input_proj = nn.Linear(2 * H, H, bias=False)
        self.final_layernorm = norm_cls(H, eps=eps)

    def forward(self, hidden, emb, mask, position_ids, rope):
        x = self.input_proj(torch.cat([self.token_layernorm(emb), self.hidden_layernorm(hidden)], dim=-1))
        out = self.layer(x, attention_mask=mask, position_ids=position_ids, position_embeddings=rope)
        return self.final_layernorm(out[0] if isinstance(out, tuple) else out)


def speculators_logits(export, verifier, ids, hidden) -> torch.Tensor:
    """The export read as speculators' MTPDraftModel reads it -> first-step logits [1, T-1, V] (h_i, embed t_{i+1})."""
    cfg = json.loads((export / "config.json").read_text())
    tc = copy.deepcopy(cfg["transformer_layer_config"])
    model_type = tc["model_type"]
    config = transformers.AutoConfig.for_model(**tc)
    config._attn_implementation = "eager"
    if model_type == "qwen3":
        from transformers.models.qwen3 import modeling_qwen3 as m
        decoder, norm, rotary, idx = m.Qwen3DecoderLayer, m.Qwen3RMSNorm, m.Qwen3RotaryEmbedding, 0
    elif model_type == "qwen3_5_text":
        from transformers.models.qwen3_5 import modeling_qwen3_5 as m
        decoder, norm, rotary = m.Qwen3_5DecoderLayer, m.Qwen3_5RMSNorm, m.Qwen3_5TextRotaryEmbedding
    elif model_type == "qwen3_5_moe_text":
        from transformers.models.qwen3_5_moe import modeling_qwen3_5_moe as m
        decoder, norm, rotary = m.Qwen3_5MoeDecoderLayer, m.Qwen3_5MoeRMSNorm, m.Qwen3_5MoeTextRotaryEmbedding
    else:
        from transformers.models.qwen3_next import modeling_qwen3_next as m
        decoder, norm, rotary = m.Qwen3NextDecoderLayer, m.Qwen3NextRMSNorm, m.Qwen3NextRotaryEmbedding
    if model_type != "qwen3":
        idx = max(i for i, t in enumerate(config.layer_types) if t == "full_attention")
    layer = SpeculatorsMTPLayer(config, decoder, norm, idx)
    own = ("input_proj", "hidden_layernorm", "token_layernorm", "final_layernorm")  # the mixin's; the rest: the layer's
    with read_tensors(export) as t:
        weights = {(k if k.split(".")[0] in own else "layer." + k): t.tensor(name).float()
                   for name in t for k in [name.removeprefix("mtp_layers.0.")]}
    layer.load_state_dict(weights, strict=True)
    with read_tensors(verifier) as t:  # the embedding and head, from the verifier as speculators takes them
        embed = t.tensor("model.embed_tokens.weight").float()
        head = t.tensor("lm_head.weight").float() if "lm_head.weight" in t else embed
    T = ids.shape[1] - 1
    pos = torch.arange(T)[None]
    rope_pos = pos[None].expand(3, -1, -1) if model_type.startswith("qwen3_5") else pos  # Qwen3.5's MRoPE sections
    mask = torch.full((T, T), float("-inf")).triu(1)[None, None]
    with torch.no_grad():
        h = layer(hidden[:, :T], nn.functional.embedding(ids[:, 1:], embed), mask, pos, rotary(config)(hidden, rope_pos))
    return h @ head.T


def ours(path, ids):
    model = mtp.load_model(path, dtype="float32").eval()
    with torch.no_grad():
        hidden = model.hidden(ids)
        hd = next(iter(model.mtp_hidden_states(ids, 1, hidden=hidden)))
        return hidden, model.mtp_head(hd, 1)


@pytest.mark.parametrize("case", ["qwen3_retrofit", "qwen3_5", "qwen3_5_moe", "qwen3_next"])
def test_export_computes_our_mtp_as_speculators_reads_it(tmp_path, case):
    if case == "qwen3_retrofit":
        path = retrofitted(tmp_path)
    elif case == "qwen3_next":
        path = tmp_path / case
        path.mkdir()
        build_reference(path)
    else:
        moe = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=16, shared_expert_intermediate_size=24)
        path = tmp_path / case
        mtp.save_model(tiny_model(seed=1, **(moe if case == "qwen3_5_moe" else {})), path)
    export = tmp_path / "export"
    cfg = export_speculators(path, export, verifier="org/base", draft_tokens=4, dtype="float32")
    assert cfg["speculators_model_type"] == "mtp" and cfg["architectures"] == ["MTPDraftModel"]
    assert cfg["num_nextn_predict_layers"] == 1
    proposal = cfg["speculators_config"]["proposal_methods"][0]
    assert proposal["proposal_type"] == "greedy" and proposal["speculative_tokens"] == 4
    assert cfg["speculators_config"]["verifier"]["name_or_path"] == "org/base"
    names = set(read_tensors(export))
    assert all(n.startswith("mtp_layers.0.") for n in names) and "mtp_layers.0.input_proj.weight" in names
    if case in ("qwen3_5_moe", "qwen3_next"):  # experts fused, as transformers' Qwen3.5-MoE layer holds them
        assert {"mtp_layers.0.mlp.experts.gate_up_proj", "mtp_layers.0.mlp.experts.down_proj"} <= names
    ids = torch.randint(0, 64, (1, 24), generator=torch.Generator().manual_seed(0))
    hidden, want = ours(path, ids)
    got = speculators_logits(export, path, ids, hidden)
    assert (got - want).abs().max().item() < 1e-4
    assert torch.equal(got.argmax(-1), want.argmax(-1))


def test_export_keeps_the_stored_tensors_bit_for_bit(tmp_path):
    path = tmp_path / "bf16"
    mtp.save_model(tiny_model(seed=2).to(torch.bfloat16), path)
    export = tmp_path / "export"
    export_speculators(path, export)
    src = {k: f.tensor(n) for k, (f, n) in read_tensors(path).items()}
    out = {k: f.tensor(n) for k, (f, n) in read_tensors(export).items()}
    assert torch.equal(out["mtp_layers.0.input_proj.weight"], src["mtp.fc.weight"])
    assert torch.equal(out["mtp_layers.0.token_layernorm.weight"], src["mtp.pre_fc_norm_embedding.weight"])
    assert torch.equal(out["mtp_layers.0.hidden_layernorm.weight"], src["mtp.pre_fc_norm_hidden.weight"])
    assert torch.equal(out["mtp_layers.0.self_attn.q_proj.weight"], src["mtp.layers.0.self_attn.q_proj.weight"])
    assert len(out) == sum(k.startswith("mtp.") for k in src)
    assert all(v.dtype == torch.bfloat16 for v in out.values())
    assert json.loads((export / "config.json").read_text())["dtype"] == "bfloat16"


def test_refused_models_name_the_reason_and_write_nothing(tmp_path):
    out = tmp_path / "out"
    with pytest.raises(ConfigError, match="'llama' has no MTP draft type in speculators"):
        export_speculators(retrofitted(tmp_path, arch="LlamaConfig"), out)
    with pytest.raises(ConfigError, match="exactly one MTP layer"):
        export_speculators(retrofitted(tmp_path, layers=2), out)
    with pytest.raises(ConfigError, match="has no MTP to export"):
        export_speculators(transformers_base(tmp_path), out)
    lost = tiny_model(seed=0)
    lost.mtp = None  # a fine-tune that dropped `mtp.*`: the config still declares the layer
    mtp.save_model(lost, tmp_path / "lost")
    with pytest.warns(mtp.MissingMTPWarning), pytest.raises(ConfigError, match="no MTP weights"):
        export_speculators(tmp_path / "lost", out)
    with pytest.raises(ConfigError, match="draft-tokens"):
        export_speculators(retrofitted(tmp_path), out, draft_tokens=0)
    assert not out.exists() or not any(out.iterdir())


def test_cli_export_real_process(tmp_path):
    path = tmp_path / "m"
    mtp.save_model(tiny_model(seed=0), path)
    run = subprocess.run([sys.executable, "-m", "mtp.cli", "export", str(path), str(tmp_path / "out"),
                          "--draft-tokens", "2"], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    report = json.loads(run.stdout)
    assert report["draft_tokens"] == 2 and report["transformer_layer_config.model_type"] == "qwen3_5_text"
    assert (tmp_path / "out" / "model.safetensors").is_file()
    bad = subprocess.run([sys.executable, "-m", "mtp.cli", "export", str(tmp_path / "missing"), str(tmp_path / "o2")],
                         capture_output=True, text=True)
    assert bad.returncode == 2 and "mtp export: error:" in bad.stderr
