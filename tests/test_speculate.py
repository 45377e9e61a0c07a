"""Prompt-lookup speculation on the real model: a greedy generation with drafts gives exactly the tokens of
dense prefill and greedy decoding (drafts are kept only where greedy decoding itself picks them), alone and
beside other generations, and the drafts of a quoting answer are accepted."""

from __future__ import annotations

import pytest
from conftest import dense_greedy
from kvbaton import SamplingParams
from kvbaton.backend import Engine
from kvbaton.bench.common import parallel

GREEDY = SamplingParams(max_tokens=40, ignore_eos=True)


@pytest.fixture(scope="module")
def speculating():
    engine = Engine(kv_budget="128MiB", speculate=4)
    yield engine
    engine.close()


def _quoting_prompt(engine) -> list[int]:
    """A prompt whose answer quotes it: a numbered list, asked back."""
    items = "\n".join(f"{i}. Ship crate {i} of spare valves to the north dock before noon." for i in range(1, 9))
    return engine.chat_tokens([{"role": "user", "content": f"Copy this list exactly:\n{items}"}])


def test_a_generation_with_drafts_gives_the_dense_greedy_tokens(speculating, reference):
    prompt = _quoting_prompt(speculating)
    result = speculating.complete(prompt, GREEDY)
    assert result.token_ids == dense_greedy(reference, prompt, 40)[0]
    assert speculating.scheduler.accepted > 0  # the answer quotes its prompt: drafts were kept
    speculating.release(result.handle)


def test_generations_with_drafts_beside_plain_ones_each_stay_exact(speculating, reference, corpus_tokens):
    prompts = [_quoting_prompt(speculating), corpus_tokens[100:160], corpus_tokens[500:530]]
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    results = parallel([lambda p=p: speculating.complete(p, params) for p in prompts])
    assert [r.token_ids for r in results] == [dense_greedy(reference, p, 12)[0] for p in prompts]
    speculating.release([r.handle for r in results])
