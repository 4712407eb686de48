"""Llama (`llama`) with Meta's multi-token prediction heads (Gloeckle et al. 2024): transformers' `LlamaConfig` keys
plus two of ours, `mtp_num_hidden_layers` (the extra heads: Meta's `n_future_tokens` - 1; 0 or absent: a plain Llama)
and `mtp_style` ("parallel", the only style of this family). Defaults are transformers'. `mtp convert` writes such
configs from Meta's released `params.json` (`model/meta.py`)."""

from __future__ import annotations

from dataclasses import dataclass

from .base import ConfigError, DecoderConfig


@dataclass
class LlamaConfig(DecoderConfig):
    model_types = ("llama",)
    architecture = "LlamaForCausalLM"
    mtp_keys = ("mtp_num_hidden_layers", "mtp_style")
    extension_keys = ("mtp_num_hidden_layers", "mtp_style")
    rope_types = ("default",)

    max_position_embeddings: int = 2048
    head_dim: int | None = None  # absent: hidden_size / num_attention_heads
    attention_bias: bool = False
    mlp_bias: bool = False
    bos_token_id: int | None = 1
    eos_token_id: int | list[int] | None = 2
    mtp_num_hidden_layers: int = 0
    mtp_style: str = "parallel"

    def complete(self) -> None:
        super().complete()
        if self.head_dim is None and self.num_attention_heads > 0:
            self.head_dim = self.hidden_size // self.num_attention_heads

    @property
    def rotary_dim(self) -> int:
        return self.rotary_dim_of(self.head_dim)

    def validate(self) -> None:
        super().validate()
        self.positive("head_dim")
        self.non_negative("mtp_num_hidden_layers")
        self.one_of("mtp_style", ("parallel",))
        for key in ("attention_bias", "mlp_bias"):
            if getattr(self, key):
                raise ConfigError(f"config key '{key}' is true: Llama with biases is not supported")
        tp = self.extra.get("pretraining_tp", 1)
        if tp != 1:  # transformers then splits the matmuls into slices (the same function, other rounding)
            raise ConfigError(f"config key 'pretraining_tp' is {tp!r}; supported: 1")
        self.check_rotary_dim()
