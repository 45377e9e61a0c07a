"""Constrained decoding: a request's ``response_format`` enforced token by token.

A response format (JSON, a JSON schema) is compiled by llguidance (the grammar library vLLM and
SGLang use; a Rust wheel, no torch dependency) against the model's tokenizer. Each constrained
request gets its own :class:`Constraint`, a matcher that says, before each sampling step, which
tokens keep the output valid (the others' logits become -inf), and follows each sampled token.

The mask is applied to one request's own next-token logits in its lifecycle, after the (batched,
possibly fused) forward: batching and the fused decode path are untouched, and constrained and
unconstrained requests share forwards.

Invariants: a schema that does not compile is ``InvalidRequest`` before the request takes a block;
a constrained request ends ``"stop"`` only where its grammar accepts (it ended, or the model chose
end-of-sequence where the grammar allows it), otherwise ``"length"``; the tokenizer's grammar view
is built once per process, on first use.
"""

from __future__ import annotations

import functools
import threading

import llguidance
import llguidance.hf
import numpy as np
import torch
from kvbaton.errors import InvalidRequest
from kvbaton.types import ResponseFormat, SamplingParams

from .loader import LoadedModel

# Compact JSON: a 135M model given free whitespace can loop on it until max_tokens.
_JSON_OPTIONS = {"whitespace_flexible": False}
_ANY_JSON_OBJECT = {"type": "object"}


@functools.lru_cache(maxsize=256)
def _grammar(format_json: str) -> str:
    """llguidance's grammar of a response format (given as its JSON, so that it can be cached)."""
    fmt = ResponseFormat.model_validate_json(format_json)
    schema = _ANY_JSON_OBJECT if fmt.type == "json_object" else (fmt.json_schema or {}).get("schema", {})
    try:
        return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=_JSON_OPTIONS)
    except ValueError as exc:
        raise InvalidRequest(f"response_format schema is not valid: {exc}") from None


class Constraint:
    """One request's matcher: the allowed next tokens, and where the output stands."""

    def __init__(self, matcher: llguidance.LLMatcher, vocab: int) -> None:
        self._matcher = matcher
        self._vocab = vocab

    def mask(self, logits: torch.Tensor) -> torch.Tensor:
        """``logits`` (``[vocab]``) with every token the grammar does not allow next set to -inf."""
        bits = np.frombuffer(self._matcher.compute_bitmask(), dtype=np.uint8)
        allowed = torch.from_numpy(np.unpackbits(bits, bitorder="little")[: self._vocab].astype(bool))
        return logits.masked_fill(~allowed.to(logits.device), float("-inf"))

    def advance(self, token: int) -> None:
        """Follow a sampled token (one the mask allowed)."""
        if not self._matcher.consume_token(token):  # cannot happen after mask(): a bug, never a silent wrong answer
            raise RuntimeError(f"constrained decoding: token {token} rejected: {self._matcher.get_error()}")

    @property
    def ended(self) -> bool:
        """The grammar admits nothing more: the output is complete."""
        return self._matcher.is_stopped()


# The grammar view of each tokenizer: built once per process (about 0.4 s), like the models themselves
# (loader.load_model), and shared by every engine on that tokenizer.
_tokenizers: dict[tuple[str, int], llguidance.LLTokenizer] = {}
_tokenizers_lock = threading.Lock()


def _llg_tokenizer(loaded: LoadedModel) -> llguidance.LLTokenizer:
    key = (loaded.tokenizer_fingerprint, loaded.vocab_size)
    with _tokenizers_lock:
        if key not in _tokenizers:
            _tokenizers[key] = llguidance.hf.from_tokenizer(
                loaded.tokenizer, n_vocab=loaded.vocab_size, eos_token=sorted(loaded.eos_token_ids)
            )
        return _tokenizers[key]


class Constraints:
    """The response formats of one loaded model: compiles them and starts a :class:`Constraint` per request."""

    def __init__(self, loaded: LoadedModel) -> None:
        self._loaded = loaded

    def start(self, params: SamplingParams) -> Constraint | None:
        """The constraint of a request (None: unconstrained). Raises InvalidRequest for a bad schema."""
        fmt = params.response_format
        if fmt is None or fmt.type == "text":
            return None
        grammar = _grammar(fmt.model_dump_json())  # key order kept: JSON properties are generated in schema order
        matcher = llguidance.LLMatcher(_llg_tokenizer(self._loaded), grammar, log_level=0)
        if matcher.is_error():
            raise InvalidRequest(f"response_format cannot be enforced: {matcher.get_error()}")
        return Constraint(matcher, self._loaded.vocab_size)
