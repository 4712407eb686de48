"""The family seam: what decoding, training, bench, heal and the server use, whatever family they run.

A family (one file: `qwen3_5.py`, `deepseek_v3.py`, ...) subclasses `CausalLM`. It must supply (abstract below):
- `config_class` (its `mtp.config` dataclass) and `__init__(config, with_mtp=None)` building `self.model` (with
  `embed_tokens`, `layers` - decoder layers, each `forward(x, pos, cache)` and `new_state(...)` - and
  `norm`), `self.lm_head` (`output_head`), `self.mtp` (an `MTPModule`, or None) and `self.rotary` (its RoPE table);
- `new_mtp_module()`: a fresh MTP module for its config; `init_weights(std, modules)`: its init for training;
- `mtp_tensor_pattern(config)`: where its checkpoints keep the MTP tensors, for messages.
It may override, each declared here with the default most families use:
- `internal_name` / `checkpoint_name`: checkpoint tensor name <-> our parameter name (default: the same name);
  `is_mtp_tensor` follows from `internal_name` (our MTP parameters are `mtp.*` in every family);
- `checkpoint_config(config, names)`: what only the tensor names tell (whether DeepSeek-style MTP layers hold their
  own embedding); `experts_key`: the config key counting routed experts, for families whose checkpoints may store
  experts one tensor per expert (read fused, written back as read: `checkpoint_sources` / `checkpoint_state`);
- `fp32_parameters` (name suffixes kept in fp32 whatever the dtype), `mtp_input_projection` and `keep_precision` (the
  linears quantization leaves in bf16: `precise_layers`);
- `final_hidden(x)` / `head(h)` (MiMo's MTP reads the pre-norm state), `hidden_width` (Meta's heads read another state
  than the head: `llama.py`), `router_aux_loss` (MoE families), `positions` / `decode_positions` / `prepare_decode`
  (one rotary table per layer kind: `mimo_v2.py`).
Everything else - the prefill/training forward, the decode forward (a plain step, a verify, a batch), the
teacher-forced MTP hidden states, the checkpoint state - is written once here. docs/architecture.md tables the seam
and draws one speculative round.
"""

from __future__ import annotations

import re
import warnings
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from typing import ClassVar, NamedTuple

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from .cache import Cache, KVCache, Positions
from .linear import (
    FastLinear,
    FusedProjections,
    Sources,
    bf16_kernel,
    fusable,
    int4_fits,
    int4_supported,
    quantized_kernel,
    renew_prepared,
)
from .linear import prepare_for_inference as prepare_linears
from .moe import Experts, group_experts, split_experts
from .rope import RotaryTable

# Weight-only quantizations `prepare_for_inference` (and `load_model(quantize=...)`) apply.
QUANTIZE = ("int8", "int4")
# Our name of MTP layer i's parameters, in every family: `mtp.layers.{i}.<rest>`.
MTP_LAYER = re.compile(r"^mtp\.layers\.(\d+)\.(.+)$")


class PickRule(NamedTuple):
    """How the C programs pick rows' tokens where logits are shaped (the one-call draft chain, `CausalLM.mtp_draft`,
    and the one-call round's verify, model/step.py `RoundProgram.sample`): each sampled row takes argmax(x + noise) at
    each of its T positions, x = logits (repetition-penalised) / temperature, -inf below its top_k-th largest and
    where its top-p cuts (model/top_p.c); a greedy row the argmax of its (penalised) logits."""

    temperature: torch.Tensor  # [B] fp32, 1 for a greedy row
    greedy: torch.Tensor  # [B] bool
    top_k: torch.Tensor  # [B] long, the vocabulary size where a row has none
    noise: torch.Tensor | None  # [B, T, V] fp32: each position's Gumbel noise (None where every row is greedy)
    q: torch.Tensor | None  # [B, T, V] fp32 to fill with every row's x (the unseeded rule's draft logits), or None
    penalty: torch.Tensor | None = None  # [B] fp32 repetition penalties (1: none), or None: no row has one
    seen: torch.Tensor | None = None  # [B, V] bool: the tokens each row has seen before the round (with penalty)
    top_p: torch.Tensor | None = None  # [B] fp32 top-p (1: none), or None: no row has one (the verify's rule only)


class NonFiniteLogitsWarning(UserWarning):
    """A forward gave NaN/Inf logits: greedy decoding would emit token 0 (often end-of-text) with no other sign."""


class MTPModule(nn.Module, ABC):
    """What a family's MTP module offers the decoder and the trainer: `layers` (one decoder layer each, addressed by
    depth), `style`, `num_layers`, and the calls below; a family implements `step` and overrides the rest only where
    its module differs (Qwen3.5's parallel heads have a maximum depth; some MTP layers own an embedding or head)."""

    style: str = "sequential"  # "sequential" (each depth feeds the next: the causal chain) or "parallel" (Meta's heads)
    layers: nn.ModuleList

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def max_depth(self) -> int | None:
        """Deepest draft step (None: any, the layers reused cyclically)."""
        return None

    def layer_for_depth(self, d: int) -> int:
        """Which layer (and so which cache) serves depth d (1-based): layers reused cyclically."""
        return (d - 1) % self.num_layers

    def embed_for_depth(self, d: int) -> nn.Module | None:
        """The MTP's own embedding for depth d (None: the backbone's)."""
        return None

    def head_for_depth(self, d: int) -> nn.Module | None:
        """The MTP's own output head for depth d (None: the backbone's `lm_head`)."""
        return None

    @abstractmethod
    def step(self, d: int, hidden: torch.Tensor, emb: torch.Tensor | None, pos: Positions,
             cache: KVCache | None = None) -> torch.Tensor:
        """h^{d-1} [B, T, H] (+ the embedding of the tokens d ahead [B, T, H], sequential style) -> h^d [B, T, H]."""

    def fill(self, d: int, hidden: torch.Tensor, emb: torch.Tensor | None, pos: Positions, cache: KVCache) -> None:
        """`step`'s writes into depth d's cache at pos (what later drafts attend to), its output not needed (the MTP
        reading a prompt). A family whose layer can write its cache alone overrides this; the default runs `step`."""
        self.step(d, hidden, emb, pos, cache)

    def new_state(self, batch: int, max_len: int, dtype: torch.dtype, device: torch.device | str) -> list[KVCache]:
        """One decode state per layer."""
        return [layer.new_state(batch, max_len, dtype, device) for layer in self.layers]


class CausalLM(nn.Module, ABC):
    """Backbone + head + optional MTP module, with the calls every caller shares (see the module docstring)."""

    config_class: ClassVar[type]
    # Name suffixes of parameters kept in fp32 whatever the model's dtype (DeepSeek's router, as transformers keeps it).
    fp32_parameters: ClassVar[tuple[str, ...]] = ()
    # The MTP's input projection (its name's suffix; None: the family has none): kept in bf16 when the rest is
    # quantized (serving engines learned that int8 there costs acceptance; vLLM keeps `mtp.fc` unquantised), but
    # quantized drafts (`quantize_drafts`) quantize it too - only the drafts read it, and on the shipped model int4
    # there left the acceptance as it was while a bf16 one was ~5% of an int4 speculative run (docs/decisions.md,
    # 2026-12-06 sixth session). Families name theirs.
    mtp_input_projection: ClassVar[str | None] = "mtp.fc"
    # The other linears kept in bf16 when the rest is quantized, drafts included (routers: quantizing them changes
    # which experts run).
    keep_precision: ClassVar[tuple[str, ...]] = ()
    # Of those, the ones that run qmatmul's bf16 product ("bf16-native") even where bf16 layers run oneDNN's
    # (MTP_BF16=torch): what a family's one-call draft reads (Qwen3.5: model/step.py), so the draft and the layers give
    # the same bits. The rest (routers) run what bf16 layers run (`linear.bf16_kernel`).
    native_bf16: ClassVar[tuple[str, ...]] = ()
    # The config key counting routed experts when checkpoints may hold them per expert (None: no MoE layers).
    experts_key: ClassVar[str | None] = None

    @classmethod
    def precise_layers(cls) -> tuple[str, ...]:
        """Name suffixes of the linears quantization leaves in bf16: the MTP's input projection and `keep_precision`."""
        return ((cls.mtp_input_projection,) if cls.mtp_input_projection else ()) + cls.keep_precision

    config: object
    model: nn.Module
    lm_head: nn.Module
    mtp: MTPModule | None
    rotary: RotaryTable | None = None  # the rotary tables `positions` reads (None: the family applies no RoPE)

    def __init__(self) -> None:
        super().__init__()
        self.gradient_checkpointing = False
        self.tokenizer = None  # a `mtp.io.Tokenizer`, set by the loader when the folder has one
        self.source_path: str | None = None
        self.checkpoint_layout: dict = {}  # how the checkpoint stored what the model holds in another form
        self.prepared = False  # prepare_for_inference ran (the decoder prepares a model that was not)

    def output_head(self, tie: bool) -> nn.Linear:
        """The output head [H -> V] for a family's __init__, once `self.model.embed_tokens` exists; tied: the
        embedding's weight (one parameter, as transformers ties it)."""
        emb = self.model.embed_tokens
        head = nn.Linear(emb.embedding_dim, emb.num_embeddings, bias=False)
        if tie:
            head.weight = emb.weight
        return head

    # ------------------------------------------------------------------ what a family supplies
    @abstractmethod
    def new_mtp_module(self) -> MTPModule:
        """A fresh MTP module for this config (training heads onto a checkpoint that has none)."""

    @abstractmethod
    def init_weights(self, std: float | None = None, modules: nn.Module | None = None) -> None:
        """Initialise for training from scratch (all of the model, or only `modules`) by the family's rule."""

    @staticmethod
    @abstractmethod
    def mtp_tensor_pattern(config) -> str:
        """Where the checkpoint keeps its MTP tensors (for messages), e.g. 'mtp.*'."""

    # ------------------------------------------------------------------ what a family may override
    def positions(self, start: int, length: int) -> Positions:
        """Positions start..start+length-1 with the family's rotary tables (`self.rotary`, when it has one)."""
        rotary = self.rotary
        cos, sin = (None, None) if rotary is None else rotary(start, length, self.dtype, self.device)
        return Positions(start, length, cos, sin)

    def final_hidden(self, x: torch.Tensor) -> torch.Tensor:
        """The last layer's output -> the hidden state `hidden()` returns (and the MTP reads): the final norm."""
        return self.model.norm(x)

    def head(self, hidden: torch.Tensor) -> torch.Tensor:
        """Backbone hidden [..., H] -> logits [..., V]."""
        return self.lm_head(hidden)

    def mtp_embed(self, ids: torch.Tensor, d: int) -> torch.Tensor:
        """Embedding the MTP depth d reads for token ids [B, T] (the backbone's unless the MTP has its own)."""
        own = self.mtp.embed_for_depth(d)
        return (own if own is not None else self.model.embed_tokens)(ids)

    def mtp_head_module(self, d: int) -> nn.Module:
        """The output head MTP depth d uses (the backbone's unless the MTP has its own)."""
        own = self.mtp.head_for_depth(d)
        return own if own is not None else self.lm_head

    def mtp_head(self, hidden: torch.Tensor, d: int) -> torch.Tensor:
        """MTP depth-d hidden [..., H] -> logits [..., V]."""
        return self.mtp_head_module(d)(hidden)

    def draft_head_module(self, d: int) -> nn.Module:
        """The head MTP depth d drafts with: its quantized copy (`quantize_drafts`), else `mtp_head_module(d)`."""
        head = self.mtp_head_module(d)
        return self.__dict__.get("_draft_heads", {}).get(id(head), head)

    def draft_head(self, hidden: torch.Tensor, d: int) -> torch.Tensor:
        """MTP depth-d hidden [..., H] -> the logits a draft is picked from [..., V]: `mtp_head`'s, or its quantized
        copy's (`quantize_drafts`)."""
        copy = self.__dict__.get("_draft_heads", {}).get(id(self.mtp_head_module(d)))
        return self.mtp_head(hidden, d) if copy is None else copy(hidden)

    def prepare_for_inference(self, quantize: str | None = None, release: bool = False,
                              on_quantized: Callable[[torch.Tensor], None] | None = None,
                              sources: Sources | None = None,
                              experts: dict[str, Callable[[int], tuple[torch.Tensor, torch.Tensor]]] | None = None
                              ) -> None:
        """Swap the linear layers for row-invariant CPU inference kernels (`model/linear.py`): bf16 weights use
        qmatmul's bf16 product (or, where it cannot run, oneDNN's packed layout: `linear.bf16_kernel`), fp32
        weights a row-by-row product; `quantize` "int8" (weight-only, per-channel scales)
        or "int4" (weight-only, groups of 128, `linear.Int4Weight`) quantizes every linear layer and every routed
        expert but `precise_layers` (bf16; "bf16-native" for `native_bf16`); a layer the int4 kernel cannot run
        (outputs not a multiple of 16, inputs not of 32) gets int8. Parameters and the state dict stay as they are; a
        no-op off CPU. The decoder calls it once on a model that was not prepared (`prepared`).

        Quantizing goes layer by layer; `on_quantized(weight)` is called with each float weight once its codes exist
        (unquantized: once its copy for qmatmul's bf16 product exists; the loader drops its memory-mapped pages there).
        `release=True` (inference only) then lets go of each quantized layer's float weight (`FastLinear.release`,
        `Experts.release`): the model holds the codes, the embedding and the output heads (kept in bf16: the reduced
        draft vocabulary reads their rows); training it or changing a released weight raises `ReleasedWeightError`.
        Unquantized, it lets go of the float weight of each layer on qmatmul's bf16 product but the output heads (its
        packed copy is the same numbers: `FastLinear.restore` unpacks it): a weight decoded at load (FP8, GPTQ) is
        then held once, as a memory-mapped bf16 checkpoint's is.
        `sources`: the layers, by module name, prepared from what their checkpoint gives (`linear.LayerSource`) rather
        than from a weight they hold: with quantize "int4" / "int8", a checkpoint's own codes (`int4_checkpoint_layers`,
        `int8_checkpoint_layers`); unquantized, a packed copy for qmatmul's bf16 product (`packed_bf16_layers`: a
        weight decoded as its layer is packed, FP8 straight into the packing); quantized with `release`, the weight to
        quantize (`quantized_layers`: decoded one layer at a time). Those weights are meta, never loaded, except int4
        codes' without `release`. `experts` likewise for the routed experts (`quantized_experts`), by module name:
        expert e's weights, decoded as it is quantized (`Experts.prepare`)."""
        self.prepared = True
        if self.device.type != "cpu":
            return
        heads = {id(h) for h in self._output_heads()}
        if quantize is None:
            def packed_copy(layer: FastLinear) -> None:  # a bf16 weight on qmatmul's product: its packed copy runs
                if layer.kernel == "bf16-native" and layer._native:
                    if on_quantized is not None:
                        on_quantized(layer.weight)
                    if release and id(layer) not in heads:
                        layer.release()

            if self.dtype in (torch.bfloat16, torch.float32):
                prepare_linears(self, "bf16" if self.dtype == torch.bfloat16 else "fp32", prepared=packed_copy,
                                sources=sources)
            if self.__dict__.get("masks") is not None:  # its LoRA hooks need each projection's own forward
                self.masks.unfuse(self)
            return
        if quantize not in QUANTIZE:
            raise ValueError(f"quantize must be one of {', '.join(QUANTIZE)}, got {quantize!r}")
        if self.dtype != torch.bfloat16:
            raise ValueError(f"quantize={quantize!r} needs a bfloat16 model (load it with dtype='bfloat16'), got {self.dtype}")

        def quantized(layer: FastLinear) -> None:
            if on_quantized is not None:
                on_quantized(layer.weight)
            if release and id(layer) not in heads:
                layer.release()

        keep = self.precise_layers()
        if quantize == "int4":
            unfit = [n for n, m in self.named_modules() if isinstance(m, nn.Linear) and not int4_fits(m)
                     and not any(n.endswith(s) for s in keep)]
            prepare_linears(self, "int4", skip=keep + tuple(unfit), prepared=quantized, sources=sources)
            for name in unfit:
                prepare_linears(self.get_submodule(name), "int8", prepared=quantized, sources=sources, prefix=name)
        else:
            prepare_linears(self, quantize, skip=keep, prepared=quantized, sources=sources)
        for name, m in self.named_modules():
            if any(name.endswith(s) for s in keep) and isinstance(m, nn.Linear):
                prepare_linears(m, "bf16-native" if any(name.endswith(s) for s in self.native_bf16) else "bf16")
            elif isinstance(m, Experts) and "_kernels" not in m.__dict__ and not any(name.endswith(s) for s in keep):
                m.prepare(quantize, (experts or {}).get(name))
                if on_quantized is not None:
                    on_quantized(m.gate_up_proj)
                    on_quantized(m.down_proj)
                if release:
                    m.release()
        if self.__dict__.get("masks") is not None:
            self.masks.unfuse(self)

    def renew_prepared(self) -> int:
        """`linear.renew_prepared` of the model and of its quantized draft heads (copies, not modules of the model):
        what changed in place since it was prepared is prepared again. Returns how many were renewed."""
        return renew_prepared(self) + sum(renew_prepared(h) for h in self.__dict__.get("_draft_heads", {}).values())

    @property
    def draft_quantize(self) -> str | None:
        """The precision `quantize_drafts` set ("int8" / "int4"), or None."""
        return self.__dict__.get("_draft_quantize")

    def quantize_drafts(self, bits: str) -> None:
        """Draft in `bits` ("int8" / "int4", weight-only, as `prepare_for_inference` quantizes): the MTP module's
        linear layers and experts (but `keep_precision`, and layers already quantized; its input projection too)
        are quantized in place, and each depth drafts with a quantized copy of its head (`draft_head_module`; the copy
        shares the weight). The backbone and its head are untouched, so the output is too: every draft is verified by
        the backbone's own head; only the acceptance can move. What it buys: a draft step reads about half (int8) or
        a quarter (int4) of a bf16 one's bytes (docs/decisions.md, 2026-12-04, second session). A prepared bf16 model
        on the CPU with an MTP module; an int4 layer the kernel cannot run gets int8.

        In a model quantized already (`--quantize int8`, an int8 checkpoint), int4 drafts requantize the MTP's int8
        layers to int4 in place (from their float weight, or from their codes where it was released:
        `FastLinear.requantize`), its int8 experts alike, and copy an int8 head to int4; int4 layers stay as they
        are (in an int4 model only the input projection, kept bf16 by `prepare_for_inference`, changes)."""
        if bits not in QUANTIZE:
            raise ValueError(f"draft quantization must be one of {', '.join(QUANTIZE)}, got {bits!r}")
        if self.mtp is None:
            raise ValueError("quantized drafts: the model has no MTP module")
        if self.device.type != "cpu" or self.dtype != torch.bfloat16:
            raise ValueError(f"quantized drafts need a bfloat16 model on the CPU, got {self.dtype} on {self.device.type}")
        if self.draft_quantize is not None:
            raise ValueError(f"the drafts are already quantized ({self.draft_quantize})")
        if not self.prepared:
            self.prepare_for_inference()
        # the MTP's packed bf16 layers let go of by an inference load get their float weights back to be quantized
        # from, and let them go again below
        restored = [m for m in self.mtp.modules() if isinstance(m, FastLinear) and m.released and m.kernel == "bf16-native"]
        for m in restored:
            m.restore()
        prefix = "mtp"  # (the attribute's name: the full names `precise_layers` are written in start with it)
        heads = {id(h) for h in self._output_heads()}
        keep = self.keep_precision
        linears = [(n, m) for n, m in self.mtp.named_modules(prefix=prefix) if isinstance(m, nn.Linear)]
        # not the heads (copied below), layers kept precise; a quantized layer only to fewer bits (requantized)
        todo: dict[str, list[str]] = {}  # kernel -> the names of the layers that get it
        for n, m in linears:
            if id(m) in heads or any(n.endswith(s) for s in keep):
                continue
            if isinstance(m, FastLinear) and m.kernel in QUANTIZE:
                if coarser(m, bits):
                    m.requantize("int4")
                continue
            todo.setdefault(quantized_kernel(bits, m), []).append(n)
        for kernel, names in todo.items():  # (skip: every other layer of the MTP, by its full name)
            prepare_linears(self.mtp, kernel, skip=tuple(n for n, _ in linears if n not in names), prefix=prefix)
        for m in self.mtp.modules():  # a fusion of requantized parts still held their int8 codes: fused again
            fusion = m.__dict__.get("_fused")
            if fusion is not None and any(p.kernel != fusion.fused.kernel for p in fusion.parts):
                if fusable(fusion.parts):
                    m.__dict__["_fused"] = FusedProjections(fusion.parts)
                else:
                    del m.__dict__["_fused"]
        for name, m in self.mtp.named_modules(prefix=prefix):
            if not isinstance(m, Experts) or any(name.endswith(s) for s in keep):
                continue
            if "_kernels" not in m.__dict__:
                m.prepare(bits)
            else:  # quantized already: an int8 expert's layers to int4 (at real size the experts a token reads dominate)
                for layer in (k for pair in m._kernels for k in pair if coarser(k, bits)):
                    layer.requantize("int4")
        copies = {}
        for d in range(1, self.mtp.num_layers + 1):
            head = self.mtp_head_module(d)
            quantized = isinstance(head, FastLinear) and head.kernel in QUANTIZE
            if id(head) in copies or (quantized and not coarser(head, bits)):
                continue
            copy = nn.Linear(head.in_features, head.out_features, bias=head.bias is not None, device="meta")
            copy.weight = head.weight  # (one parameter: the copy holds only its codes; heads keep their float weight)
            copy.bias = head.bias
            copies[id(head)] = FastLinear.wrap(copy, quantized_kernel(bits, head))
        for m in restored:
            m.release()
        for m in self.mtp.modules():  # (a release swaps in a placeholder; the fusions record what their parts hold)
            if (fusion := m.__dict__.get("_fused")) is not None:
                fusion.versions = [p.weight._version for p in fusion.parts]
        self.__dict__["_draft_heads"] = copies
        self.__dict__["_draft_quantize"] = bits

    def packed_bf16_layers(self) -> list[str]:
        """The linear layers (module names) that `prepare_for_inference(release=True)` of this bf16 model, on the CPU,
        packs for qmatmul's bf16 product and then lets go of: every one but the output heads, where that product runs
        (`linear.bf16_kernel`). Their weights need never be held as [out, in] tensors: a load (of a model still on the
        meta device) may hand their packed copies to `prepare_for_inference` (`packed`) instead."""
        return self._linears_but_heads(()) if bf16_kernel() == "bf16-native" else []

    def quantized_layers(self) -> list[str]:
        """The linear layers (module names) that `prepare_for_inference(quantize, release=True)` of this model, on the
        CPU, quantizes ("int8" / "int4") and then lets go of: every one but `precise_layers` and the output heads
        (kept: the reduced draft vocabulary reads their rows). A load (of a model still on the meta device) may hand
        their float weights to `prepare_for_inference` one at a time (`weights`) instead of holding them all."""
        return self._linears_but_heads(self.precise_layers())

    def _linears_but_heads(self, keep: tuple[str, ...]) -> list[str]:
        """The model's (unprepared) linear layers, by module name, but the output heads and those named by `keep`."""
        heads = {id(h) for h in self._output_heads()}
        return [n for n, m in self.named_modules()
                if type(m) is nn.Linear and id(m) not in heads and not any(n.endswith(s) for s in keep)]

    def quantized_experts(self) -> list[str]:
        """The routed experts (module names) that `prepare_for_inference(quantize, release=True)` quantizes and lets go
        of: every `Experts` but `precise_layers`. A load may hand their weights to it one expert at a time (`experts`)."""
        keep = self.precise_layers()
        return [n for n, m in self.named_modules() if isinstance(m, Experts) and not any(n.endswith(s) for s in keep)]

    def int8_checkpoint_layers(self, names: list[str], quantize: str) -> list[str]:
        """Of the linear layers `names` (module names) whose checkpoint stores int8 codes with one scale per row, those
        that `prepare_for_inference(quantize)` runs as "int8" on the codes themselves: every one of `quantized_layers`
        with "int8"; with "int4" those the int4 kernel cannot run (they get int8)."""
        layers = set(self.quantized_layers())
        return [n for n in names if n in layers and (quantize == "int8" or not int4_fits(self.get_submodule(n)))]

    def int4_checkpoint_layers(self, int4_groups: dict[str, int]) -> list[str]:
        """Of the linear layers (module name -> the group size of their int4 checkpoint codes), those that
        `prepare_for_inference("int4")` can run on the codes themselves: int4 layers (not `precise_layers`, not an
        output head: those keep their float weights) whose shape the kernels run at the checkpoint's group size."""
        keep = self.precise_layers()
        heads = {id(h) for h in self._output_heads()}
        out = []
        for name, group in int4_groups.items():
            m = self.get_submodule(name)
            if (type(m) is nn.Linear and id(m) not in heads and not any(name.endswith(s) for s in keep) and int4_fits(m)
                    and int4_supported(m.out_features, m.in_features, group)):
                out.append(name)
        return out

    def _output_heads(self) -> list[nn.Module]:
        """The backbone's output head and every MTP depth's own one (`head_for_depth`)."""
        heads = [self.lm_head]
        if self.mtp is not None:
            heads += [h for d in range(1, self.mtp.num_layers + 1) if (h := self.mtp.head_for_depth(d)) is not None]
        return heads

    def router_aux_loss(self, router_logits: list) -> torch.Tensor | None:
        """The MoE load-balancing loss over collected router logits (None: the family has no such loss)."""
        return None

    @staticmethod
    def check_finite(logits: torch.Tensor, where: str = "the forward") -> bool:
        """True when logits [..., V] are all finite; otherwise warn (NonFiniteLogitsWarning) that `where` gave
        NaN/Inf - what a decoder calls before sampling, so that a generation of only end-of-text says why."""
        if bool(torch.isfinite(logits).all()):
            return True
        warnings.warn(f"{where} gave non-finite logits (NaN or Inf): the weights or the activations overflowed; the "
                      "tokens generated from them are meaningless", NonFiniteLogitsWarning, stacklevel=2)
        return False

    # ------------------------------------------------------------------ checkpoint names and layout
    @staticmethod
    def internal_name(name: str, config=None) -> str | None:
        """Checkpoint tensor name -> our parameter name (None: not part of the model, e.g. a vision tower)."""
        return name

    @staticmethod
    def checkpoint_name(name: str, config=None) -> str:
        """Our parameter name -> the checkpoint's (the inverse of `internal_name`)."""
        return name

    @classmethod
    def is_mtp_tensor(cls, name: str, config=None) -> bool:
        """Is this checkpoint tensor part of the MTP module? (Ours are `mtp.*` in every family.)"""
        ours = cls.internal_name(name, config)
        return ours is not None and ours.startswith("mtp.")

    @classmethod
    def keeps_fp32(cls, name: str) -> bool:
        """Is this parameter (our name or the checkpoint's) kept in fp32 whatever the model's dtype (`fp32_parameters`)?"""
        return any(name == s or name.endswith("." + s) for s in cls.fp32_parameters)

    @classmethod
    def checkpoint_config(cls, config, names: list[str]):
        """The config completed with what only the checkpoint's tensor names tell (default: nothing)."""
        return config

    @classmethod
    def checkpoint_sources(cls, names: list[str], shape, config) -> tuple[dict, dict]:
        """Checkpoint tensor names -> ({our parameter: checkpoint name | moe.Stack}, the layout read). `shape(name)`
        gives a checkpoint tensor's shape. One to one through `internal_name`; with `experts_key`, per-expert tensors
        are stacked into the fused parameters (`moe.group_experts`, whose errors name the tensor and the key)."""
        sources = {ours: n for n in names if (ours := cls.internal_name(n, config)) is not None}
        if cls.experts_key is None:
            return sources, {}
        return group_experts(sources, shape, getattr(config, cls.experts_key), config.moe_intermediate_size,
                             experts_key=cls.experts_key)

    def checkpoint_state(self) -> dict[str, torch.Tensor]:
        """The tensors `save_model` writes, under the checkpoint's names, in the layout the model was read in (a tied
        head is not written, as transformers does; experts per expert unless they were read fused)."""
        state = self.state_dict()
        if self.config.tie_word_embeddings:
            state.pop("lm_head.weight", None)
        state = split_experts(state, self.checkpoint_layout)
        return {self.checkpoint_name(k, self.config): v for k, v in state.items()}

    # ------------------------------------------------------------------ basics
    @property
    def has_mtp(self) -> bool:
        """True when the model can draft for itself: it holds MTP weights (loaded, or initialised for training) or a
        mask-token adapter is attached (`model/masks.py`)."""
        return self.mtp is not None or self.__dict__.get("masks") is not None

    @property
    def dtype(self) -> torch.dtype:
        return self.model.embed_tokens.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.model.embed_tokens.weight.device

    @property
    def hidden_width(self) -> int:
        """The last dim of the hidden states `hidden()` / `decode()` return (the decoder sizes the states it keeps by
        it): hidden_size, unless the head and the MTP read different states (Meta's heads, `llama.py`: 2 x hidden)."""
        return self.config.hidden_size

    @property
    def context_length(self) -> int:
        return self.config.max_position_embeddings

    @property
    def eos_token_ids(self) -> list[int]:
        return self.config.eos_token_ids

    # ------------------------------------------------------------------ backbone
    def hidden(self, ids: torch.Tensor, cache: Cache | None = None, router_logits: list | None = None) -> torch.Tensor:
        """Backbone hidden states: ids [B, T] -> [B, T, H]. With a single-sequence cache (a prefill), continue from
        `cache.pos` and advance it by T. `router_logits` (a list): MoE layers append their router logits to it."""
        T = ids.shape[1]
        if T == 0:  # nothing to read (the C kernels take at least one token; an empty read crashed in them)
            return torch.empty(ids.shape[0], 0, self.hidden_width, dtype=self.dtype, device=self.device)
        start = 0 if cache is None else cache.pos
        if cache is not None:
            cache.check_room(T)
        pos = self.positions(start, T)
        pos.router_logits = router_logits
        x = self.model.embed_tokens(ids)
        for i, layer in enumerate(self.model.layers):
            if self.gradient_checkpointing and self.training and cache is None:
                x, _ = checkpoint(layer, x, pos, None, use_reentrant=False)
            else:
                x, _ = layer(x, pos, None if cache is None else cache.layers[i])
        if cache is not None:
            cache.pos = start + T
        return self.final_hidden(x)

    def forward(self, ids: torch.Tensor, cache: Cache | None = None) -> torch.Tensor:
        """Backbone logits: ids [B, T] -> [B, T, V]."""
        return self.head(self.hidden(ids, cache))

    # ------------------------------------------------------------------ decode forwards (static shapes)
    def decode_positions(self, index: torch.Tensor, starts: list[int] | None = None) -> Positions:
        """Positions of a decode forward: index [B, T] (long, on the device) with the family's rotary tables gathered
        for them; `starts` (each row's first position, on the host) lets eager attention read exactly each row's keys.
        The rotary table must reach the positions already (`prepare_decode`)."""
        rotary = self.rotary
        cos, sin = (None, None) if rotary is None else rotary.gather(index, self.dtype)
        return Positions(0, index.shape[1], cos, sin, starts=starts, index=index)

    def prepare_decode(self, max_len: int) -> None:
        """Build what decode forwards up to position max_len - 1 read but cannot grow themselves (rotary tables)."""
        rotary = self.rotary
        if rotary is not None:
            rotary.ensure(max_len, self.dtype, self.device)

    def decode(self, ids: torch.Tensor, cache: Cache, pos: Positions) -> tuple[torch.Tensor, list]:
        """A decode forward (a plain step, a verify, many rows at their own positions): ids [B, T] at positions
        pos.index (`decode_positions`) -> (hidden [B, T, H], one entry per layer: `DeltaSteps` or None). Attention
        layers write their keys/values at those positions; recurrent states stay as they were until
        `cache.keep_at(steps, n)` selects the state after each row's first n tokens (a `pos.commit` step may update
        them in place instead, and return None for them). Static shapes and no host
        synchronisation (with `pos.starts` None), so the forward can be compiled or captured as a graph."""
        x = self.model.embed_tokens(ids)
        steps = []
        for i, layer in enumerate(self.model.layers):
            x, st = layer(x, pos, cache.layers[i])
            steps.append(st)
        return self.final_hidden(x), steps

    def new_cache(self, batch: int, max_len: int, rows: bool = False) -> Cache:
        """Preallocated backbone decode state for `max_len` slots (the caller sizes it to what its sequences need, plus
        the slots a round writes past a sequence's end - possibly past the context length); `rows`: a position per
        batch row (continuous batching)."""
        layers = [layer.new_state(batch, max_len, self.dtype, self.device) for layer in self.model.layers]
        return Cache(layers, max_len, [0] * batch if rows else None)

    # ------------------------------------------------------------------ MTP
    def new_mtp_cache(self, batch: int, max_len: int) -> list:
        """One decode state per MTP layer."""
        if self.mtp is None:
            raise RuntimeError("this model has no MTP module")
        return self.mtp.new_state(batch, max_len, self.dtype, self.device)

    def mtp_draft(self, K: int, pend_h: torch.Tensor, pend_next: torch.Tensor, pend_n: torch.Tensor,
                  mtp_pos: torch.Tensor, caches: list, width: int, host: tuple[list[int], list[int]],
                  vocab: tuple[nn.Module, torch.Tensor] | None = None,
                  sampling: PickRule | None = None) -> torch.Tensor | None:
        """The round's draft chain (decode/round.py `draft`: a sequential MTP, greedy or `sampling`'s rule) as one call
        -> drafts [B, K], where the family has one (None: the round runs it step by step, to the same drafts, caches
        and q). The arguments are the round state's (`RoundState`) and the host's (mtp_pos, pend_n); `vocab`: a reduced
        draft vocabulary's head layer and its token ids [N] instead of the full head (decode/draft_vocab.py). K = 0:
        depth 1 reads the `width` pending positions and nothing is drafted (decode/round.py `catch_up`) -> [B, 0]."""
        return None

    def round_program(self, K: int, commit: bool, cache: Cache, mtp_caches: list | None, pos: torch.Tensor,
                      pend_h: torch.Tensor | None, pend_next: torch.Tensor | None, pend_n: torch.Tensor | None,
                      mtp_pos: torch.Tensor | None, vocab: tuple[nn.Module, torch.Tensor] | None = None, scratch=None):
        """A whole greedy round of K drafts (the draft chain, the verify forward, its head and argmax, the recurrent
        states' keep) bound to a round state's caches and tensors for decode/round.c, where the family runs its
        forwards as C programs (Qwen3.5: model/step.py `RoundProgram`); None: the round runs its steps. `commit`: a
        plain step every row keeps; `scratch(n)`: n bytes its per-token DeltaNet updates may take (shared by the rounds
        of one state)."""
        return None

    def mtp_step(self, d: int, hidden: torch.Tensor, next_ids: torch.Tensor | None, start: int | list[int] | Positions,
                 caches: list | None = None, router_logits: list | None = None) -> torch.Tensor:
        """MTP depth d at positions start..start+T-1 (or the given decode `Positions`): h^{d-1} [B, T, H] and the
        tokens that follow each position [B, T] (None for parallel heads) -> h^d [B, T, H]. With `caches` (from
        `new_mtp_cache`) the depth's layer writes its keys/values there."""
        mtp = self.mtp
        emb = self.mtp_embed(next_ids, d) if mtp.style == "sequential" else None
        cache = None if caches is None else caches[mtp.layer_for_depth(d)]
        pos = start if isinstance(start, Positions) else self.positions(start, hidden.shape[1])
        pos.router_logits = router_logits
        return mtp.step(d, hidden, emb, pos, cache)

    def mtp_fill(self, d: int, hidden: torch.Tensor, next_ids: torch.Tensor | None, start: int, caches: list) -> None:
        """`mtp_step`'s cache writes for depth d at positions start..start+T-1 without its output (`MTPModule.fill`):
        h^{d-1} [B, T, H], the tokens that follow each position [B, T] (None for parallel heads)."""
        mtp = self.mtp
        emb = self.mtp_embed(next_ids, d) if mtp.style == "sequential" else None
        mtp.fill(d, hidden, emb, self.positions(start, hidden.shape[1]), caches[mtp.layer_for_depth(d)])

    def mtp_hidden_states(self, ids: torch.Tensor, depth: int | None = None, hidden: torch.Tensor | None = None,
                          router_logits: list | None = None) -> Iterator[torch.Tensor]:
        """Yield h^d [B, T-d, H] for d = 1..depth, teacher-forced with the true tokens.

        Position i of depth d predicts token i+d+1. `hidden` (the backbone's [B, T, H]) is computed when not
        given. A generator, so a trainer can take the loss depth by depth. `router_logits`: as in `hidden`."""
        if self.mtp is None:
            raise RuntimeError("this model has no MTP module (the checkpoint held no MTP tensors)")
        depth = self.mtp.num_layers if depth is None else depth
        max_depth = self.mtp.max_depth
        if depth < 1 or (max_depth is not None and depth > max_depth):
            raise ValueError(f"depth must be in 1..{max_depth or 'any'}, got {depth}")
        T = ids.shape[1]
        if depth >= T:
            raise ValueError(f"depth {depth} needs sequences longer than {T} tokens")
        h0 = self.hidden(ids) if hidden is None else hidden
        prev = h0
        for d in range(1, depth + 1):
            n = T - d
            source = prev if self.mtp.style == "sequential" else h0
            out = self.mtp_step(d, source[:, :n], ids[:, d:], 0, router_logits=router_logits)
            prev = out
            yield out

    def mtp_logits(self, ids: torch.Tensor, depth: int | None = None) -> list[torch.Tensor]:
        """List over d = 1..depth of [B, T-d, V]: position i predicts token i+d+1 (teacher forcing)."""
        return [self.mtp_head(h, d) for d, h in enumerate(self.mtp_hidden_states(ids, depth), start=1)]


def init_weights_(model: CausalLM, std: float | None = None, seed: int | None = None) -> None:
    """Initialise a model for training from scratch (its family's rule), optionally seeding torch first."""
    if seed is not None:
        torch.manual_seed(seed)
    model.init_weights(std)


def coarser(layer: FastLinear, bits: str) -> bool:
    """Would `bits` drafts requantize this quantized layer? An int8 layer int4 drafts can run (int4's shapes)."""
    return bits == "int4" and layer.kernel == "int8" and int4_fits(layer)
