"""Turning next-token logits into tokens: every row of a step at once (:func:`sample_rows`), or one row.

A step's rows are sampled together: the rows that need it are masked (a grammar's allowed tokens, EOS
before ``min_tokens``), the greedy ones take one batched argmax, the others are drawn one by one from
their own generator (a seeded request gives the same tokens whatever else runs beside it), and the log
probabilities asked for are read from the unmasked rows (the model's distribution at temperature 1).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import torch
from kvbaton.types import PromptTokenLogprob, SamplingParams, TokenLogprob, TopLogprob

from .request import RawLogprob

if TYPE_CHECKING:
    from .request import Request


def sample_rows(
    logits: Sequence[torch.Tensor], requests: Sequence[Request],
) -> tuple[list[int], list[RawLogprob | None]]:
    """The next token of each request from its row of ``logits`` (``[vocab]`` each, fp32), and its log
    probability where the request asks for them."""
    rows, copied = _batch(logits)
    logprobs: list[RawLogprob | None] = [None] * len(requests)
    wanted = [i for i, r in enumerate(requests) if r.params is not None and r.params.logprobs]
    distributions = torch.log_softmax(rows[wanted].float(), dim=-1) if wanted else None  # before any mask
    masked = [i for i, r in enumerate(requests)
              if r.constraint is not None or (r.generated < r.params.min_tokens and r.banned)]  # type: ignore[union-attr]
    if masked and not copied:
        rows = rows.clone()  # masking leaves the runner's logits alone
    for i in masked:
        request = requests[i]
        if request.constraint is not None:
            rows[i] = request.constraint.mask(rows[i])
        if request.generated < request.params.min_tokens:  # type: ignore[union-attr] - too early to end: no EOS
            rows[i, request.banned] = float("-inf")
    greedy = [r.params is not None and r.params.greedy for r in requests]
    best = torch.argmax(rows, dim=-1).tolist() if any(greedy) else []
    tokens = [best[i] if greedy[i] else sample(rows[i], r.params, r.rng)  # type: ignore[arg-type]
              for i, r in enumerate(requests)]
    for j, i in enumerate(wanted):
        assert distributions is not None
        logprobs[i] = raw_logprob(distributions[j], tokens[i], requests[i].params.top_logprobs)  # type: ignore[union-attr]
    return tokens, logprobs


def raw_logprob(distribution: torch.Tensor, token: int, top: int) -> RawLogprob:
    """``token``'s log probability in ``distribution`` (log-softmaxed ``[vocab]``) and the ``top`` most likely."""
    values, ids = torch.topk(distribution, top) if top else (distribution[:0], distribution[:0].long())
    return token, float(distribution[token]), list(zip(ids.tolist(), values.tolist(), strict=True))


def _batch(rows: Sequence[torch.Tensor]) -> tuple[torch.Tensor, bool]:
    """``[n, vocab]`` of the rows, and whether it is a copy: consecutive rows of one tensor (a runner's batch of
    decode rows) are used in place, anything else is stacked."""
    first = rows[0]
    base = first._base
    if base is not None and base.dim() == 2 and first.dim() == 1 and first.is_contiguous():
        width, start = base.stride(0), first.storage_offset()
        if all(r._base is base and r.storage_offset() == start + i * width for i, r in enumerate(rows)):
            return base.as_strided((len(rows), first.shape[0]), (width, 1), start), False
    return torch.stack(list(rows)), True


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


def token_logprob(raw: RawLogprob, vocab: Callable[[int], bytes]) -> TokenLogprob:
    """A sampled token's log probability (the model's distribution at temperature 1, before any constraint),
    with the most likely tokens; ``vocab`` gives a token's own bytes (a byte-level BPE fragment's too, where
    decoding it alone would give U+FFFD)."""
    token, logprob, top = raw
    alternatives = []
    for i, v in top:
        text = vocab(i)
        alternatives.append(TopLogprob(token_id=i, token=token_text(text), logprob=v, bytes=list(text)))
    text = vocab(token)
    return TokenLogprob(token_id=token, token=token_text(text), logprob=logprob, bytes=list(text),
                        top_logprobs=alternatives)


def unscored_token(token: int, vocab: Callable[[int], bytes]) -> PromptTokenLogprob:
    """A prompt's first token: nothing before it predicts it, so it has no log probability (None, as OpenAI
    answers)."""
    raw = vocab(token)
    return PromptTokenLogprob(token_id=token, token=token_text(raw), logprob=None, bytes=list(raw))


def scored_tokens(logits: torch.Tensor, targets: Sequence[int], top: int,
                  vocab: Callable[[int], bytes]) -> list[PromptTokenLogprob]:
    """Each of ``targets`` with its log probability under the row of ``logits`` before it (``[len(targets),
    vocab]``) and the ``top`` most likely tokens there."""
    out = []
    for row, token in zip(logits, targets, strict=True):
        raw = raw_logprob(torch.log_softmax(row.float(), dim=-1), token, top)
        out.append(PromptTokenLogprob(**dict(token_logprob(raw, vocab))))
    return out
