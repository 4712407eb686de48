"""Any transformers causal LM with attention-only layers as an `mtp` family (`HFCausalLM`): Llama, Mistral, Qwen2,
Qwen3, Gemma, Phi-3, OLMo-2, Granite, SmolLM3 (`SUPPORTED`), so decode, bench, serve, train and `mtp retrofit` run
on models that were trained without MTP.

transformers builds the model (`AutoModelForCausalLM.from_config`) and runs its own code: embedding (Gemma's
scaling), decoder layers, norms, RoPE of every type it implements. What we change is where attention keeps its keys:
the model is built with `attn_implementation="mtp"` (`hf_attention.py`), so every attention call reaches our
position-addressed `KVCache` and our decode rules, with `position_ids` = our decode positions. Rolling a speculative
round back is then free (entries are addressed by position), and a verify row, a batch row and a plain step compute
the same numbers (the linear layers become our row-invariant `FastLinear`s in `prepare_for_inference`, like every
family's). transformers' own cache and mask code are not used.

Parameter names are the checkpoint's (`model.*`, `lm_head.weight`): our module holds transformers' base model as
`model` and its `lm_head`. The MTP module for these architectures (no native layout exists) is DeepSeek-V3's next-n
layer built from the backbone's own decoder layer class, held and saved as `mtp.layers.{i}.*`:
    x = eh_proj(cat[enorm(embed(t_{i+d})), hnorm(h^{d-1}_i)])     (embedding first, as DeepSeek-V3)
    h^d_i = shared_head.norm(decoder_layer(x))                     -> logits of t_{i+d+1} by the backbone's head
with `enorm`, `hnorm`, `shared_head.norm` of the backbone's norm class; the config key `mtp_num_hidden_layers`
counts them (docs/families.md, "Any transformers causal LM").

Refused (`REFUSED`, one line each): recurrent and hybrid layers (their state is not addressed by position:
rollback would need a per-token state this wrapper does not have), mixture-of-experts MLPs (experts multiply a
token-dependent number of rows, so a verify row would not be bit-identical to its plain step), attention logit
soft-capping and attention sinks (not in our attention), ALiBi and learned absolute positions (not RoPE through
`position_ids` on the attention interface), and any other architecture until a parity test lists it in `SUPPORTED`.
"""

from __future__ import annotations

import copy
import inspect
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import nn

from ..config import ConfigError, HFConfig
from ..config.base import short
from .base import CausalLM, MTPModule
from .cache import Cache, KVCache, Positions
from .hf_attention import ATTENTION, AttentionState, attention_forward
from .rowwise import rowwise

# model_type -> transformers' causal LM class name; each one has a parity test (tests/test_hf_family.py).
SUPPORTED: dict[str, str] = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "gemma": "GemmaForCausalLM",
    "phi3": "Phi3ForCausalLM",
    "olmo2": "Olmo2ForCausalLM",
    "granite": "GraniteForCausalLM",
    "smollm3": "SmolLM3ForCausalLM",
}
_RECURRENT = "recurrent or hybrid layers: their state is not addressed by position, so a rejected draft cannot be rolled back"
_MOE = ("mixture-of-experts MLPs: experts multiply a token-dependent number of rows, so a verified token would not be "
        "bit-identical to its plain step")
REFUSED: dict[str, str] = {
    **{t: _RECURRENT for t in ("mamba", "mamba2", "falcon_mamba", "jamba", "falcon_h1", "zamba", "zamba2", "bamba",
                               "granitemoehybrid", "lfm2", "lfm2_moe", "qwen3_next", "rwkv", "recurrent_gemma", "xlstm",
                               "minimax", "nemotron_h", "hunyuan_v1_moe_hybrid", "plamo2", "kimi_linear")},
    **{t: _MOE for t in ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "granitemoe", "phimoe", "dbrx", "deepseek_v2",
                         "jetmoe", "gpt_oss", "llama4", "ernie4_5_moe", "dots1", "hunyuan_v1_moe", "glm4v_moe")},
    "gemma2": "attention logit soft-capping, which our attention does not implement",
    "gemma3_text": "two RoPE tables chosen per layer type (local and global), not yet wired to the MTP layer",
    "gemma3n": "KV sharing across layers, which our per-layer cache does not model",
    "cohere2": "layers without RoPE mixed with RoPE layers, not verified",
    "bloom": "ALiBi position biases (applied through the attention mask, which our attention does not read)",
    "mpt": "ALiBi position biases (applied through the attention mask, which our attention does not read)",
    "falcon": "ALiBi or parallel-attention variants, not verified",
    "gpt2": "Conv1D projections and learned absolute positions, not verified",
    "opt": "learned absolute positions, not verified",
}
# Head extras of the causal LM classes (config key -> what its forward does to the logits).
HEAD_EXTRAS = ("logits_scaling", "final_logit_softcapping", "logit_scale")


@dataclass
class HFCausalConfig(HFConfig):
    """A transformers causal LM's config.json: the keys the seam reads are fields (missing ones are completed from
    transformers' own defaults for the model type); every other key is kept verbatim in `extra` and handed to
    transformers' config class. `mtp_num_hidden_layers` (ours) counts the MTP layers a retrofit added."""

    model_types: ClassVar[tuple[str, ...]] = tuple(SUPPORTED)
    mtp_keys: ClassVar[tuple[str, ...]] = ("mtp_num_hidden_layers",)
    extension_keys: ClassVar[tuple[str, ...]] = ("mtp_num_hidden_layers",)

    model_type: str = "llama"
    vocab_size: int = 32000
    hidden_size: int = 4096
    num_hidden_layers: int = 32
    max_position_embeddings: int | None = None
    tie_word_embeddings: bool | None = None
    initializer_range: float | None = None
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    pad_token_id: int | None = None
    mtp_num_hidden_layers: int = 0

    @property
    def architecture(self) -> str:  # what `save_model` writes to `architectures`
        return SUPPORTED[self.model_type]

    @property
    def eos_token_ids(self) -> list[int]:
        eos = self.eos_token_id
        return [] if eos is None else [eos] if isinstance(eos, int) else list(eos)

    def transformers_dict(self) -> dict[str, Any]:
        """The config as transformers reads it (without our own keys)."""
        d = self.to_hf_dict()
        for key in self.extension_keys + ("architectures", "dtype", "torch_dtype", "transformers_version"):
            d.pop(key, None)
        return d

    def hf_config(self, mtp_layers: int = 0):
        """A fresh transformers config with our attention; `mtp_layers` more full-attention layers declared (so a
        decoder layer built for MTP layer i, index num_hidden_layers + i, finds its layer type)."""
        from transformers import AutoConfig

        _register_attention()
        d = self.transformers_dict()
        model_type = d.pop("model_type")
        cfg = AutoConfig.for_model(model_type, **d)
        cfg._attn_implementation = ATTENTION
        if mtp_layers:
            if getattr(cfg, "layer_types", None) is not None:
                cfg.layer_types = list(cfg.layer_types) + ["full_attention"] * mtp_layers
            cfg.num_hidden_layers += mtp_layers
        return cfg

    def complete(self) -> None:
        if self.model_type not in SUPPORTED:
            return  # validate names it
        try:
            cfg = self.hf_config()
        except (TypeError, ValueError, KeyError, AttributeError) as e:
            raise ConfigError(f"transformers cannot read this {self.model_type!r} config: {str(e).splitlines()[0][:200]}") from None
        for key in ("max_position_embeddings", "tie_word_embeddings", "initializer_range"):
            if getattr(self, key) is None:
                setattr(self, key, getattr(cfg, key, None) if key != "tie_word_embeddings" else bool(cfg.tie_word_embeddings))
        if self.max_position_embeddings is None:
            self.max_position_embeddings = 2048

    def validate(self) -> None:
        if self.model_type in REFUSED:
            raise ConfigError(f"config key 'model_type' is {self.model_type!r}: not supported: {REFUSED[self.model_type]}")
        self.one_of("model_type", tuple(SUPPORTED))
        self.positive("vocab_size", "hidden_size", "num_hidden_layers", "max_position_embeddings")
        self.non_negative("mtp_num_hidden_layers")
        for key in ("num_local_experts", "num_experts", "n_routed_experts"):
            if self.extra.get(key):
                raise ConfigError(f"config key '{key}' is {short(self.extra[key])}: not supported: {_MOE}")
        if self.extra.get("attn_logit_softcapping") is not None:
            raise ConfigError("config key 'attn_logit_softcapping': not supported: attention logit soft-capping")

    def write_keys(self, out: dict[str, Any]) -> None:
        out["model_type"] = self.model_type


class Rowwise(nn.Module):
    """An elementwise activation module computed through `rowwise` (the same bits for a row whatever the rows around
    it: model/rowwise.py)."""

    def __init__(self, fn: nn.Module):
        super().__init__()
        self.fn = fn

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rowwise(self.fn, x)


class HFNextNMTP(MTPModule):
    """`mtp.layers.{i}`: the backbone's decoder layer class with `enorm`, `hnorm`, `eh_proj` [H, 2H] and
    `shared_head.norm` added (the names of DeepSeek-V3's next-n layer); see the module docstring."""

    def __init__(self, layers: list[nn.Module], rotary: nn.Module, first_index: int):
        super().__init__()
        self.layers = nn.ModuleList(layers)
        self.first_index = first_index  # layer_idx of MTP layer 0 (= the backbone's layer count)
        self.__dict__["rotary"] = rotary  # the backbone's, not a submodule

    def step(self, d: int, hidden: torch.Tensor, emb: torch.Tensor | None, pos: Positions,
             cache: KVCache | None = None) -> torch.Tensor:
        """h^{d-1} [B, T, H] and the embedding of the tokens d ahead [B, T, H] -> h^d [B, T, H]."""
        i = self.layer_for_depth(d)
        layer = self.layers[i]
        x = layer.eh_proj(torch.cat([layer.enorm(emb), layer.hnorm(hidden)], dim=-1))
        ids = position_ids(pos, x)
        caches = None if cache is None else {self.first_index + i: cache}
        out = layer(x, attention_mask=None, position_ids=ids, position_embeddings=self.rotary(x, ids), use_cache=False,
                    mtp_attention=AttentionState(caches, pos))
        out = out[0] if isinstance(out, tuple) else out
        return layer.shared_head.norm(out)

    def new_state(self, batch: int, max_len: int, dtype: torch.dtype, device: torch.device | str) -> list[KVCache]:
        return [kv_cache(layer.self_attn, batch, max_len, dtype, device) for layer in self.layers]


def position_ids(pos: Positions, x: torch.Tensor) -> torch.Tensor:
    """transformers' `position_ids` [B, T] for our positions: the decode positions, or start..start+T-1."""
    if pos.decoding:
        return pos.index
    B, T = x.shape[:2]
    return torch.arange(pos.start, pos.start + T, device=x.device)[None].expand(B, T)


def kv_cache(attn: nn.Module, batch: int, max_len: int, dtype: torch.dtype, device) -> KVCache:
    """A KVCache for one transformers attention module (its kv heads and head dim)."""
    cfg = attn.config
    kv_heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
    return KVCache.allocate(batch, kv_heads, max_len, attn.head_dim, attn.head_dim, dtype, device)


def _register_attention() -> None:
    from transformers import AttentionInterface

    AttentionInterface.register(ATTENTION, attention_forward)


class HFCausalLM(CausalLM):
    """A transformers causal LM (attention-only, `SUPPORTED`) behind the family seam; see the module docstring."""

    config_class = HFCausalConfig
    mtp_input_projection = "eh_proj"

    @staticmethod
    def mtp_tensor_pattern(config: HFCausalConfig) -> str:
        return "mtp.layers.*"

    def __init__(self, config: HFCausalConfig, with_mtp: bool | None = None):
        super().__init__()
        from transformers import AutoModelForCausalLM

        _register_attention()
        self.config = config
        hf = AutoModelForCausalLM.from_config(config.hf_config(), attn_implementation=ATTENTION)
        if hf.base_model_prefix != "model" or not all(hasattr(hf.model, a) for a in ("embed_tokens", "layers", "norm")):
            raise ConfigError(f"config key 'model_type' is {config.model_type!r}: its transformers model has no "
                              "model.embed_tokens / model.layers / model.norm")
        self.__dict__["hf"] = hf  # transformers' wrapper (init rules, config); its modules are ours below
        self.model = hf.model
        self.lm_head = hf.lm_head
        rotary = hf.model.rotary_emb
        if "layer_type" in inspect.signature(rotary.forward).parameters:
            raise ConfigError(f"config key 'model_type' is {config.model_type!r}: per-layer-type RoPE is not supported")
        self.mtp = self.new_mtp_module() if with_mtp is not False and config.mtp_num_hidden_layers > 0 else None

    # ------------------------------------------------------------------ forwards
    def _backbone(self, ids: torch.Tensor, position: torch.Tensor, caches, pos: Positions) -> torch.Tensor:
        """transformers' base model over ids [B, T] at `position` [B, T], attention through our caches -> the final
        normed hidden state [B, T, H]."""
        out = self.model(input_ids=ids, position_ids=position, use_cache=False, mtp_attention=AttentionState(caches, pos))
        return out.last_hidden_state

    def hidden(self, ids: torch.Tensor, cache: Cache | None = None, router_logits: list | None = None) -> torch.Tensor:
        """ids [B, T] -> [B, T, H] (post final norm); with a single-sequence cache, from `cache.pos` on."""
        T = ids.shape[1]
        start = 0 if cache is None else cache.pos
        if cache is not None:
            cache.check_room(T)
        pos = self.positions(start, T)
        self._checkpointing(self.gradient_checkpointing and self.training and cache is None)
        x = self._backbone(ids, position_ids(pos, ids[..., None]), None if cache is None else cache.layers, pos)
        if cache is not None:
            cache.pos = start + T
        return x

    def decode(self, ids: torch.Tensor, cache: Cache, pos: Positions) -> tuple[torch.Tensor, list]:
        """A decode forward at positions pos.index [B, T] -> (hidden [B, T, H], no recurrent steps)."""
        return self._backbone(ids, pos.index, cache.layers, pos), [None] * len(self.model.layers)

    def new_cache(self, batch: int, max_len: int, rows: bool = False) -> Cache:
        layers = [kv_cache(layer.self_attn, batch, max_len, self.dtype, self.device) for layer in self.model.layers]
        return Cache(layers, max_len, [0] * batch if rows else None)

    def head(self, hidden: torch.Tensor) -> torch.Tensor:
        """Hidden [..., H] -> logits [..., V], with what the architecture's causal LM forward does to them."""
        logits = self.lm_head(hidden)
        cfg = self.hf.config
        if getattr(cfg, "logits_scaling", None):  # Granite
            logits = logits / cfg.logits_scaling
        if getattr(cfg, "final_logit_softcapping", None):
            logits = torch.tanh(logits / cfg.final_logit_softcapping) * cfg.final_logit_softcapping
        if getattr(cfg, "logit_scale", None):  # Cohere
            logits = logits * cfg.logit_scale
        return logits

    def _checkpointing(self, on: bool) -> None:
        for layer in self.model.layers:
            if hasattr(layer, "gradient_checkpointing"):
                layer.gradient_checkpointing = on

    # ------------------------------------------------------------------ MTP
    def new_mtp_module(self) -> HFNextNMTP:
        """Fresh next-n layers of the backbone's decoder layer class (layer indices after the backbone's)."""
        n, L = self.config.mtp_num_hidden_layers, self.config.num_hidden_layers
        cfg = self.config.hf_config(mtp_layers=n)
        layer_cls = type(self.model.layers[0])
        H = self.config.hidden_size
        layers = []
        for i in range(n):
            layer = layer_cls(cfg, L + i)
            layer.enorm = copy.deepcopy(self.model.norm)
            layer.hnorm = copy.deepcopy(self.model.norm)
            layer.eh_proj = nn.Linear(2 * H, H, bias=False)
            layer.shared_head = nn.Module()
            layer.shared_head.norm = copy.deepcopy(self.model.norm)
            layers.append(layer.to(device=self.device, dtype=self.dtype))
        return HFNextNMTP(layers, self.model.rotary_emb, L)

    @torch.no_grad()
    def init_weights(self, std: float | None = None, modules: nn.Module | None = None) -> None:
        """transformers' own init for the architecture (`_init_weights`), over all of the model or `modules`."""
        for m in (modules or self).modules():
            if m is not self:
                self.hf._init_weights(m)

    # ------------------------------------------------------------------ loading and inference
    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        """nn.Module's, then the buffers a checkpoint does not hold (RoPE frequencies, Gemma's embedding scale) built
        for real where the model was built on the meta device (the loader builds it there)."""
        result = super().load_state_dict(state_dict, strict=strict, assign=assign)
        self.materialize_buffers()
        return result

    @torch.no_grad()
    def materialize_buffers(self) -> None:
        """Non-persistent buffers still on the meta device -> computed by transformers' init on the weights' device
        (the loaded parameters are marked initialised, so its init touches nothing else)."""
        device = self.device
        for module in self.modules():
            meta = [n for n, b in module.named_buffers(recurse=False) if b is not None and b.is_meta]
            if not meta:
                continue
            for n in meta:
                module._buffers[n] = torch.empty_like(module._buffers[n], device=device)
            params = list(module.parameters(recurse=False))
            for p in params:
                p._is_hf_initialized = True
            try:
                if "RotaryEmbedding" in type(module).__name__:  # its own init (the base class's matches it by name)
                    from transformers.modeling_utils import PreTrainedModel

                    PreTrainedModel._init_weights(self.hf, module)
                else:
                    self.hf._init_weights(module)
            finally:
                for p in params:
                    del p._is_hf_initialized

    def prepare_for_inference(self, *args, **kwargs) -> None:
        """The family default (row-invariant linear kernels), and every MLP activation through `rowwise`."""
        for m in self.modules():
            act = m.__dict__.get("_modules", {}).get("act_fn")
            if isinstance(act, nn.Module) and not isinstance(act, Rowwise):
                m.act_fn = Rowwise(act)
        super().prepare_for_inference(*args, **kwargs)
