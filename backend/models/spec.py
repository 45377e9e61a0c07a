"""What a model family declares, and what a checkpoint's config resolves to.

A :class:`Family` (one per file in this package) knows how one transformers model family differs from the
Llama decoder layer: where its weights sit (:class:`Layout`), which norms, activation, biases, soft-capping,
query and embedding scaling, sliding windows and RoPE variants its config selects. :meth:`Family.architecture`
reads a checkpoint's config into an :class:`Architecture`, the one description every compute path (loader, CPU
kernels, eager runner, CUDA step, RoPE re-alignment) reads, and refuses, naming the field, whatever it cannot
serve exactly. The Hugging Face modules stay the definition of the math: the paths take weights, rotary tables
and norms from them, the architecture says how they are wired.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from kvbaton.errors import ModelNotFound

# RoPE variants. Static: the angle of a position depends on the position alone (any chunking of a prompt rotates
# its keys as a dense forward does). "dynamic" recomputes its frequencies only past max_position_embeddings,
# the context kvbaton serves, so within it it is static too. "longrope" switches every position's frequencies
# once a sequence passes original_max_position_embeddings, which keys already in the cache cannot follow: it is
# served up to that length (a documented exact fallback, :attr:`Architecture.notes`).
STATIC_ROPE = frozenset({"default", "linear", "llama3", "yarn", "dynamic"})
ROPE_TYPES = STATIC_ROPE | {"longrope"}
# The variants whose cached keys move to other positions by a pure rotation, rounding aside: the angle is the
# position times a fixed frequency and cos/sin carry no factor. YaRN and LongRoPE scale cos/sin (an attention
# factor) and dynamic NTK changes its frequencies with the length: keys of those are recomputed, not shifted.
SHIFTABLE_ROPE = frozenset({"default", "linear", "llama3"})


class UnsupportedModel(ModelNotFound):
    """A checkpoint of a known family with a config field kvbaton cannot serve exactly (the message names it)."""


def refuse(config: Any, field_name: str, why: str) -> UnsupportedModel:
    return UnsupportedModel(f"{getattr(config, 'model_type', '?')}: config field {field_name}: {why}")


@dataclass(frozen=True)
class Layout:
    """Where a decoder layer's weights are, as attribute names of the transformers modules.

    ``qkv`` (on ``self_attn``) and ``gate_up`` (on ``mlp``) are concatenated along their outputs, in this order,
    to give ``[q | k | v]`` and ``[gate | up]``: three modules or one already fused (Phi-3). The norms are on the
    decoder layer: ``attn_norm`` before attention, ``attn_out_norm`` on its output (Gemma's sandwich), ``mlp_norm``
    before the MLP, ``mlp_out_norm`` on its output; ``q_norm``/``k_norm`` (on ``self_attn``) norm each head of q
    and k before RoPE (Qwen3, Gemma-3)."""

    qkv: tuple[str, ...] = ("q_proj", "k_proj", "v_proj")
    o: str = "o_proj"
    gate_up: tuple[str, ...] = ("gate_proj", "up_proj")
    down: str = "down_proj"
    attn_norm: str = "input_layernorm"
    attn_out_norm: str | None = None
    mlp_norm: str = "post_attention_layernorm"
    mlp_out_norm: str | None = None
    q_norm: str | None = None
    k_norm: str | None = None


@dataclass(frozen=True)
class Rope:
    """One rotary table: its variant, base and parameters (as transformers' ``rope_parameters``)."""

    type: str
    theta: float
    parameters: tuple[tuple[str, Any], ...] = ()  # the rest of rope_parameters, sorted (hashable)
    partial: float = 1.0  # fraction of head_dim rotated

    def params(self) -> dict[str, Any]:
        return dict(self.parameters)

    def describe(self) -> str:
        extra = f", factor {self.params()['factor']:g}" if "factor" in self.params() else ""
        part = f", {self.partial:g} of each head" if self.partial != 1.0 else ""
        return f"{self.type} (theta {self.theta:g}{extra}{part})"


@dataclass(frozen=True)
class Architecture:
    """A checkpoint as every compute path sees it (see the module)."""

    family: str
    model_type: str
    layout: Layout
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    max_context: int
    norm_eps: float
    norm_offset: float  # the norms scale by (offset + weight): 0 (Llama), 1 (Gemma)
    activation: str  # transformers' ACT2FN name of the MLP's gate activation
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    attn_softcap: float | None  # scores -> cap * tanh(scores / cap) before the softmax (Gemma-2)
    final_softcap: float | None  # the same on the logits
    query_scale: float  # the factor of q . k (head_dim ** -0.5 unless the family says otherwise)
    embed_scale: float | None  # the embedding module multiplies by it (Gemma: sqrt(hidden_size))
    windows: tuple[int | None, ...]  # per layer: a sliding window of that many keys (itself included), or None
    ropes: tuple[tuple[str, Rope], ...]  # rotary tables by group ("" when the model has one)
    layer_rope: tuple[str, ...]  # per layer: its rotary group
    notes: tuple[str, ...] = ()  # exact fallbacks taken for this checkpoint (e.g. a capped context)

    @property
    def rope(self) -> dict[str, Rope]:
        return dict(self.ropes)

    @property
    def per_layer_rope(self) -> bool:
        return len(self.ropes) > 1

    @property
    def sliding(self) -> bool:
        """Some layer attends over a window shorter than the context."""
        return any(w is not None for w in self.windows)

    @property
    def features(self) -> frozenset[str]:
        """What this architecture needs beyond the Llama decoder layer (the names of :mod:`.paths`)."""
        f = set()
        lay = self.layout
        if lay.qkv != Layout.qkv or lay.gate_up != Layout.gate_up:
            f.add("fused_weights")
        if lay.q_norm:
            f.add("qk_norm")
        if self.norm_offset:
            f.add("offset_norm")
        if lay.attn_out_norm or lay.mlp_out_norm:
            f.add("sandwich_norms")
        if self.activation != "silu":
            f.add("activation")
        if self.mlp_bias:
            f.add("mlp_bias")
        if self.attn_softcap:
            f.add("attn_softcap")
        if self.final_softcap:
            f.add("final_softcap")
        if self.embed_scale:
            f.add("embed_scale")
        if self.sliding:
            f.add("sliding_window")
        if self.per_layer_rope:
            f.add("per_layer_rope")
        if any(r.partial != 1.0 for r in self.rope.values()):
            f.add("partial_rotary")
        return frozenset(f)


def _as_dict(value: Any) -> dict[str, Any]:
    return dict(value) if isinstance(value, dict) else {}


class Family:
    """One transformers model family: the Llama layer, with the differences a subclass declares.

    Subclasses set the class attributes and override the hooks whose defaults do not hold; :meth:`architecture`
    is the one entry point."""

    name: ClassVar[str]
    model_types: ClassVar[tuple[str, ...]]
    classes: ClassVar[tuple[str, ...]]  # transformers' *ForCausalLM class names
    releases: ClassVar[str]  # which published models this covers (docs)
    # A published release's config.json (the docs table's row; the tests shrink its sizes).
    release_config: ClassVar[dict[str, Any]]
    layout: ClassVar[Layout] = Layout()
    # Config fields whose non-default values change the math in a way no path implements: field -> allowed values.
    fixed_fields: ClassVar[dict[str, tuple[Any, ...]]] = {}

    # -- hooks ------------------------------------------------------------------------------------

    def windows(self, config: Any) -> list[int | None]:
        """Per layer: its sliding window from the config (transformers' ``layer_types`` where it has them)."""
        n = int(config.num_hidden_layers)
        window = getattr(config, "sliding_window", None)
        types = getattr(config, "layer_types", None)
        if types is None:
            return [None] * n
        out: list[int | None] = []
        for i, kind in enumerate(types[:n]):
            if kind == "full_attention":
                out.append(None)
            elif kind == "sliding_attention":
                if not window:
                    raise refuse(config, f"layer_types[{i}]", "a sliding layer without sliding_window")
                out.append(int(window))
            else:
                raise refuse(config, f"layer_types[{i}]", f"attention type {kind!r} is not supported")
        return out

    def activation(self, config: Any) -> str:
        return str(getattr(config, "hidden_act", "silu"))

    def query_scale(self, config: Any, head_dim: int) -> float:
        return head_dim**-0.5

    def embed_scale(self, config: Any) -> float | None:
        return None

    def norm_offset(self) -> float:
        return 0.0

    def biases(self, config: Any) -> tuple[bool, bool, bool]:
        """(q/k/v, o, mlp) biases."""
        attn = bool(getattr(config, "attention_bias", False))
        return attn, attn, bool(getattr(config, "mlp_bias", False))

    def rope_groups(self, config: Any) -> tuple[dict[str, dict[str, Any]], list[str]]:
        """The rotary tables (group -> rope_parameters) and each layer's group."""
        params = _as_dict(getattr(config, "rope_parameters", None))
        n = int(config.num_hidden_layers)
        types = getattr(config, "layer_types", None)
        if params and types and all(isinstance(params.get(t), dict) for t in set(types)):
            return {t: _as_dict(params[t]) for t in sorted(set(types))}, list(types[:n])
        if not params:
            params = {"rope_type": "default", "rope_theta": float(getattr(config, "rope_theta", 10000.0))}
        return {"": params}, [""] * n

    # -- the architecture --------------------------------------------------------------------------

    def check_fields(self, config: Any) -> None:
        if getattr(config, "quantization_config", None):
            raise refuse(config, "quantization_config", "quantized checkpoints are not supported (use the "
                         "unquantized fp32/bf16/fp16 weights)")
        for name, allowed in self.fixed_fields.items():
            value = getattr(config, name, allowed[0])
            if value not in allowed:
                raise refuse(config, name, f"{value!r} is not supported (only {', '.join(map(repr, allowed))})")

    def architecture(self, config: Any) -> Architecture:
        self.check_fields(config)
        heads = int(config.num_attention_heads)
        head_dim = int(getattr(config, "head_dim", None) or config.hidden_size // heads)
        max_context = int(config.max_position_embeddings)
        notes: list[str] = []
        groups, layer_rope = self.rope_groups(config)
        ropes: list[tuple[str, Rope]] = []
        for group, params in groups.items():
            where = f"rope_parameters[{group!r}]" if group else "rope_parameters"
            kind = str(params.get("rope_type", params.get("type", "default")))
            if kind not in ROPE_TYPES:
                raise refuse(config, f"{where}.rope_type", f"RoPE type {kind!r} is not supported "
                             f"(supported: {', '.join(sorted(ROPE_TYPES))})")
            if kind == "longrope":
                original = int(params.get("original_max_position_embeddings")
                               or getattr(config, "original_max_position_embeddings", 0) or max_context)
                if original < max_context:
                    notes.append(f"longrope: served up to original_max_position_embeddings={original} tokens (past it "
                                 "transformers switches every position's frequencies, which cached keys cannot follow)")
                    max_context = original
            partial = float(params.get("partial_rotary_factor", getattr(config, "partial_rotary_factor", 1.0) or 1.0))
            rest = tuple(sorted((k, _freeze(v)) for k, v in params.items()
                                if k not in ("rope_type", "type", "rope_theta", "partial_rotary_factor")))
            ropes.append((group, Rope(kind, float(params.get("rope_theta", 10000.0)), rest, partial)))
        windows = [None if w is None or w >= max_context else int(w) for w in self.windows(config)]
        qkv_bias, o_bias, mlp_bias = self.biases(config)
        embed = self.embed_scale(config)
        return Architecture(
            family=self.name,
            model_type=str(config.model_type),
            layout=self.layout,
            num_layers=int(config.num_hidden_layers),
            hidden_size=int(config.hidden_size),
            num_heads=heads,
            num_kv_heads=int(getattr(config, "num_key_value_heads", None) or heads),
            head_dim=head_dim,
            intermediate_size=int(config.intermediate_size),
            vocab_size=int(config.vocab_size),
            max_context=max_context,
            norm_eps=float(getattr(config, "rms_norm_eps", 1e-6)),
            norm_offset=self.norm_offset(),
            activation=self.activation(config),
            qkv_bias=qkv_bias,
            o_bias=o_bias,
            mlp_bias=mlp_bias,
            attn_softcap=_positive(getattr(config, "attn_logit_softcapping", None)),
            final_softcap=_positive(getattr(config, "final_logit_softcapping", None)),
            query_scale=float(self.query_scale(config, head_dim)),
            embed_scale=embed,
            windows=tuple(windows),
            ropes=tuple(ropes),
            layer_rope=tuple(layer_rope),
            notes=tuple(notes),
        )


def _positive(value: Any) -> float | None:
    return float(value) if value else None


def _freeze(value: Any) -> Any:
    return tuple(value) if isinstance(value, list) else value
