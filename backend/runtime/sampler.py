"""Turning next-token logits into a token under a request's sampling parameters; the token's log probability."""

from __future__ import annotations

from collections.abc import Callable

import torch
from kvbaton.types import SamplingParams, TokenLogprob, TopLogprob


def make_generator(params: SamplingParams, device: torch.device) -> torch.Generator | None:
    """A per-request RNG, so a seeded request is reproducible whatever else runs beside it."""
    if params.greedy:
        return None
    gen = torch.Generator(device=device)
    if params.seed is not None:
        gen.manual_seed(params.seed)
    else:
        gen.seed()
    return gen


def sample(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> int:
    """Pick one token from ``logits`` (``[vocab]``, fp32)."""
    if params.greedy:
        return int(torch.argmax(logits))
    # In float64 (a temperature below float32's range would become 0), shifted so the best score is 0:
    # a tiny temperature then gives -inf to the others instead of inf - inf = nan.
    scores = (logits.double() - logits.max(dim=-1, keepdim=True).values) / params.temperature
    if params.top_k and params.top_k < scores.numel():
        kth = torch.topk(scores, params.top_k).values[-1]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_scores, order = torch.sort(scores, descending=True)
        cumulative = torch.softmax(sorted_scores, dim=-1).cumsum(dim=-1)
        # Drop a token when the tokens before it already cover top_p (the first always stays).
        drop = (cumulative - torch.softmax(sorted_scores, dim=-1)) >= params.top_p
        scores = scores.scatter(0, order[drop], float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    return int(torch.multinomial(probs, 1, generator=generator))


def token_text(raw: bytes) -> str:
    """A token's text from its bytes: the UTF-8 text, or for a part of a character OpenAI's
    ``bytes:`` form (printable ASCII as is, every other byte as ``\\xNN``)."""
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return "bytes:" + "".join(chr(b) if 0x20 <= b < 0x7F and b != 0x5C else f"\\x{b:02x}" for b in raw)


def token_logprob(logits: torch.Tensor, token: int, top: int, vocab: Callable[[int], bytes]) -> TokenLogprob:
    """The log probability of ``token`` under ``logits`` (the model's distribution at temperature 1,
    before any constraint), with the ``top`` most likely tokens; ``vocab`` gives a token's own bytes
    (a byte-level BPE fragment's too, where decoding it alone would give U+FFFD)."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    alternatives = []
    if top:
        values, ids = torch.topk(logprobs, top)
        for v, i in zip(values.tolist(), ids.tolist(), strict=True):
            raw = vocab(int(i))
            alternatives.append(TopLogprob(token_id=int(i), token=token_text(raw), logprob=float(v), bytes=list(raw)))
    raw = vocab(token)
    return TokenLogprob(token_id=token, token=token_text(raw), logprob=float(logprobs[token]), bytes=list(raw),
                        top_logprobs=alternatives)
