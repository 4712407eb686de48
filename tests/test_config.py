import json

import pytest

from mtp import ConfigError, Qwen35Config
from mtp.config import ConfigWarning

# The text part of Qwen3.5-0.8B's config.json as docs/reference.md ("Config") gives it, in the multimodal shape.
QWEN35_08B = {
    "architectures": ["Qwen3_5ForConditionalGeneration"],
    "model_type": "qwen3_5",
    "image_token_id": 248056,
    "tie_word_embeddings": True,
    "text_config": {
        "model_type": "qwen3_5_text",
        "vocab_size": 248320, "hidden_size": 1024, "intermediate_size": 3584, "num_hidden_layers": 24,
        "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 256,
        "linear_num_key_heads": 16, "linear_num_value_heads": 16, "linear_key_head_dim": 128,
        "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4, "full_attention_interval": 4,
        "layer_types": [("full_attention" if (i + 1) % 4 == 0 else "linear_attention") for i in range(24)],
        "rms_norm_eps": 1e-6, "tie_word_embeddings": True, "mtp_num_hidden_layers": 1,
        "mtp_use_dedicated_embeddings": False, "max_position_embeddings": 262144, "attn_output_gate": True,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000000, "partial_rotary_factor": 0.25,
                            "mrope_section": [11, 11, 10], "mrope_interleaved": True},
        "some_future_key": {"kept": [1, 2]},
        "eos_token_id": 248044,
    },
    "vision_config": {"depth": 12, "hidden_size": 768},
}


def test_multimodal_round_trip_keeps_every_key(tmp_path):
    cfg = Qwen35Config.from_hf_dict(QWEN35_08B)
    assert cfg.hidden_size == 1024 and cfg.head_dim == 256 and cfg.rotary_dim == 64
    assert cfg.layer_types[3] == "full_attention" and cfg.layer_types[2] == "linear_attention"
    assert cfg.layer_types.count("full_attention") == 6
    assert cfg.tie_word_embeddings and cfg.mtp_num_hidden_layers == 1 and not cfg.mtp_use_dedicated_embeddings
    assert cfg.rope_theta == 10000000 and cfg.partial_rotary_factor == 0.25
    assert cfg.to_hf_dict() == QWEN35_08B
    cfg.to_json(tmp_path / "config.json")
    assert json.loads((tmp_path / "config.json").read_text()) == QWEN35_08B
    assert Qwen35Config.from_json(tmp_path / "config.json") == cfg


def test_text_only_round_trip_and_interval_derivation():
    text = dict(QWEN35_08B["text_config"])
    del text["layer_types"]
    text["architectures"] = ["Qwen3_5ForCausalLM"]
    cfg = Qwen35Config.from_hf_dict(text)
    assert cfg.layer_types is None  # derived layer by layer, never built as a list
    assert [cfg.layer_type(i) for i in range(24)] == QWEN35_08B["text_config"]["layer_types"]
    assert cfg.to_hf_dict() == text


def test_flat_rope_keys_round_trip():
    text = {"model_type": "qwen3_5_text", "vocab_size": 32, "hidden_size": 16, "num_hidden_layers": 2,
            "rope_theta": 5000.0, "partial_rotary_factor": 0.5, "head_dim": 8, "full_attention_interval": 2}
    cfg = Qwen35Config.from_hf_dict(text)
    assert cfg.rope_theta == 5000.0 and cfg.rotary_dim == 4
    out = cfg.to_hf_dict()
    assert out["rope_theta"] == 5000.0 and "rope_parameters" not in out


def test_explicit_layer_types_win_over_the_interval_with_a_warning():
    """transformers writes all-attention models as layer_types + the default interval: it loads them, so do we."""
    data = json.loads(json.dumps(QWEN35_08B))
    data["text_config"]["layer_types"] = ["full_attention"] * 24
    with pytest.warns(ConfigWarning, match="'layer_types' disagrees with 'full_attention_interval' \\(4\\)"):
        cfg = Qwen35Config.from_hf_dict(data)
    assert cfg.layer_types == ["full_attention"] * 24
    out = cfg.to_hf_dict()
    assert out["text_config"]["layer_types"] == ["full_attention"] * 24  # written back as read


@pytest.mark.parametrize("mutate, key", [
    (lambda t: t.update(num_hidden_layers=23), "layer_types"),
    (lambda t: t.update(num_key_value_heads=3), "num_key_value_heads"),
    (lambda t: t.update(linear_num_key_heads=3), "linear_num_key_heads"),
    (lambda t: t.update(rope_theta=1.0), "rope_theta"),
    (lambda t: t.update(tie_word_embeddings=False), "tie_word_embeddings"),
    (lambda t: t.update(hidden_size=0), "hidden_size"),
    (lambda t: t["layer_types"].__setitem__(0, "mamba"), "layer_types[0]"),
    (lambda t: t.update(mtp_num_hidden_layers=-1), "mtp_num_hidden_layers"),
    (lambda t: t.pop("vocab_size"), "vocab_size"),
])
def test_bad_or_contradictory_values_name_the_key(mutate, key):
    data = json.loads(json.dumps(QWEN35_08B))
    mutate(data["text_config"])
    with pytest.raises(ConfigError, match=f"'{key.replace('[', '.').replace(']', '.')}"):
        Qwen35Config.from_hf_dict(data)


def test_bad_json_names_the_file(tmp_path):
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="config.json"):
        Qwen35Config.from_json(tmp_path / "config.json")
