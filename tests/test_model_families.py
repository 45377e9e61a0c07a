"""Every model family of the registry, end to end, on a tiny random-weight checkpoint built from a published
release's config.json (``tests/tiny_checkpoints.py``: 2 layers, windows shortened, fp32 on CPU):

- greedy decoding is token-identical to transformers' own ``generate`` for a prompt longer than every window,
  on the paths the registry routes the family to (kvbaton's C++ kernels where they fit, the torch ops where
  the head size has no kernel, the fused prefill);
- resume and fork are token-identical to dense prefill (transformers' forward with its own cache);
- cross-prefix reuse moves keys exactly at layer 0 where the RoPE can be re-aligned, and recomputes with the
  reason where it cannot;
- the checkpoint's chat template, EOS list and sampling defaults are the ones used;
- unknown model types and unsupported config fields are refused by name; the docs table is the registry's.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import kvbaton
import pytest
import torch
from conftest import dense_greedy
from kvbaton.backend import Engine
from kvbaton.backend.compute.cpu import fast_decode as fd
from kvbaton.backend.models import FAMILIES, UnsupportedModel, architecture, docs
from kvbaton.backend.models.paths import CUDA_GRAPHS, kernel_refusal
from kvbaton.errors import ModelNotFound
from tiny_checkpoints import GENERATION, TINY, build, config_of
from transformers import AutoConfig, AutoModelForCausalLM

GREEDY = kvbaton.SamplingParams(max_tokens=12, ignore_eos=True)
TEXT = ("Agents pass handles to each other instead of text, so the second agent reads what the first one "
        "already computed. ") * 4
REPO = Path(__file__).resolve().parents[1]


@dataclass
class Loaded:
    name: str
    directory: Path
    engine: Engine
    reference: Any  # transformers' model of the same checkpoint (its eager attention: soft-capping included)

    def tokens(self, n: int, offset: int = 0) -> list[int]:
        return self.engine.tokenize(TEXT)[offset : offset + n]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("checkpoints")


@pytest.fixture(scope="module", params=list(TINY))
def family(request: pytest.FixtureRequest, checkpoints: Path):
    directory = build(request.param, checkpoints)
    engine = Engine(model=str(directory), kv_budget="16MiB", block_size=16)
    reference = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32, attn_implementation="eager")
    yield Loaded(request.param, directory, engine, reference.eval())
    engine.close()


def test_greedy_decoding_matches_transformers_generate_past_every_window(family):
    arch = family.engine.loaded.arch
    prompt = family.tokens(60)
    assert all(w is None or w < len(prompt) for w in arch.windows)
    assert any(w is not None for w in arch.windows) == (family.name in ("qwen2", "mistral", "phi3", "gemma2", "gemma3"))
    with torch.inference_mode():
        out = family.reference.generate(torch.tensor([prompt]), max_new_tokens=GREEDY.max_tokens, do_sample=False,
                                        eos_token_id=None, pad_token_id=GENERATION["pad_token_id"])
        dense_logits = family.reference(torch.tensor([prompt])).logits[0, -1]
    result = family.engine.resume(family.engine.materialize(prompt), [], GREEDY)
    assert result.token_ids == out[0, len(prompt):].tolist()
    logits = family.engine.next_token_logits(family.engine.materialize(prompt[:-20]), prompt[-20:])
    assert torch.max(torch.abs(logits - dense_logits)).item() < 1e-4
    # ...on the fast paths: kvbaton's kernels where the head size has one, the fused prefill patched in
    fast = family.engine.runner.fast
    assert fast is not None and fast.weights.kernels == (fd.KVBATON if kernel_refusal(arch) is None else fd.ONEDNN)
    assert getattr(family.engine.loaded.model, "_kvbaton_prefill", None)


def test_chunks_and_scattered_recomputation_cutting_through_windows_give_the_dense_logits(family):
    """A prompt prefilled in chunks whose boundaries fall inside the windows (a chunk of a few tokens through
    the fused decode rows, the others through the prefill kernels), then tokens recomputed at scattered
    positions (selective recomputation): every logit is transformers' dense one."""
    from kvbaton.backend.compute.runner import Chunk

    engine, tokens = family.engine, family.tokens(60)
    with torch.inference_mode():
        dense = family.reference(torch.tensor([tokens])).logits[0]
    blocks = engine.pool.allocate(len(tokens) // engine.pool.block_size + 1)
    try:
        for a, b in ((0, 23), (23, 37), (42, 60)):
            if a == 42:  # 5 tokens: rows of the fused decode step, last logits only
                last = engine.runner.forward([Chunk(blocks, 37, tokens[37:42])])[0]
                torch.testing.assert_close(last, dense[41], atol=1e-4, rtol=0)
            got = engine.runner.forward([Chunk(blocks, a, tokens[a:b], all_logits=True)])[0]
            torch.testing.assert_close(got, dense[a:b], atol=1e-4, rtol=0)
        picked = [5, 17, 30, 44, 59]
        got = engine.runner.forward([Chunk(blocks, picked[0], [tokens[p] for p in picked], all_logits=True,
                                           positions=picked)])[0]
        torch.testing.assert_close(got, dense[picked], atol=1e-4, rtol=0)
    finally:
        engine.pool.decref(blocks)


def test_resume_and_fork_are_token_identical_to_dense_prefill(family):
    engine = family.engine
    prefix = family.tokens(40)
    handle = engine.materialize(prefix)
    first = engine.resume(handle, family.tokens(9, 40), GREEDY)
    expected, _ = dense_greedy(family.reference, prefix + family.tokens(9, 40), GREEDY.max_tokens)
    assert first.token_ids == expected and first.exact
    for child, offset in zip(engine.fork(handle, 2), (50, 60)):
        suffix = family.tokens(7, offset)
        expected, _ = dense_greedy(family.reference, prefix + suffix, GREEDY.max_tokens)
        assert engine.resume(child, suffix, GREEDY).token_ids == expected
    # a resumed handle continues exactly (its windows slide on past the first turn)
    second = engine.resume(first.handle, family.tokens(5, 70), GREEDY)
    history = prefix + family.tokens(9, 40) + first.token_ids + family.tokens(5, 70)
    assert second.token_ids == dense_greedy(family.reference, history, GREEDY.max_tokens)[0]


def test_cross_prefix_reuse_is_rotated_exactly_or_recomputed_with_its_reason(family):
    engine = family.engine
    sys_a = engine.chat_tokens([{"role": "system", "content": "You read."}], add_generation_prompt=False)
    sys_b = engine.chat_tokens([{"role": "system", "content": "You are the reviewer of it all."}],
                               add_generation_prompt=False)
    doc = family.tokens(48)
    source = engine.materialize(sys_a + doc)
    composed = engine.compose(sys_b, [source.segment(len(sys_a), len(sys_a) + len(doc))], mode="rotate")
    (segment,) = composed.segments
    if engine.shifter.shiftable():
        assert segment.outcome == "rotated" and not composed.exact
        k, _ = engine.kv_rows(composed.handle, len(sys_b), len(doc))
        k_dense, _ = engine.kv_rows(engine.materialize(sys_b + doc), len(sys_b), len(doc))
        torch.testing.assert_close(k[0], k_dense[0], atol=1e-5, rtol=0)  # layer 0: the re-alignment itself
    else:
        assert family.name == "gemma3"
        assert segment.outcome == "recomputed" and composed.exact
        assert "per-layer" in segment.reason and "per-layer rotary tables" in engine.shifter.reason
        expected, _ = dense_greedy(family.reference, sys_b + doc, 4)
        result = engine.resume(composed.handle, [], kvbaton.SamplingParams(max_tokens=4, ignore_eos=True))
        assert result.token_ids == expected


def test_the_checkpoint_brings_its_chat_template_eos_list_and_sampling_defaults(family):
    loaded = family.engine.loaded
    text = family.engine.tokenizer.decode(family.engine.chat_tokens([{"role": "user", "content": "Hi"}]))
    marker = {"gemma": "<start_of_turn>user", "phi3": "<|user|>", None: "<|im_start|>user"}[TINY[family.name].template]
    assert marker in text
    assert {0, 2} <= loaded.eos_token_ids
    assert loaded.generation_defaults == {k: GENERATION[k] for k in ("do_sample", "temperature", "top_p", "top_k")}
    assert loaded.max_context == config_of(family.name)["max_position_embeddings"]
    # what an OpenAI request that sets no sampling gets (the SDK's SamplingParams() stays greedy)
    assert family.engine.sampling_defaults == {k: GENERATION[k] for k in ("temperature", "top_p", "top_k")}


def test_an_openai_request_that_sets_no_sampling_samples_as_the_checkpoint_says(checkpoints):
    import httpx
    from kvbaton.backend.server import create_app

    engine = Engine(model=str(build("llama", checkpoints)), kv_budget="16MiB", block_size=16)
    app = create_app(engine)

    async def ask(**sampling):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://kvbaton", timeout=120) as http:
            model = (await http.get("/v1/models")).json()["data"][0]["id"]
            body = {"model": model, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 12, "seed": 5,
                    **sampling}
            answer = await http.post("/v1/chat/completions", json=body)
            assert answer.status_code == 200, answer.text
            return answer.json()["choices"][0]["message"]["content"]

    import anyio

    try:
        unset = anyio.run(ask)
        assert unset == anyio.run(lambda: ask(temperature=GENERATION["temperature"], top_p=GENERATION["top_p"],
                                              top_k=GENERATION["top_k"]))
    finally:
        engine.close()


# -- model-free: the registry's refusals, paths and docs ------------------------------------------------------------

def _config(family: str, **changes: Any) -> Any:
    fields = {**FAMILIES[family].release_config, **changes}
    return AutoConfig.for_model(fields.pop("model_type"), **fields)


@pytest.mark.unit
def test_unknown_model_types_and_unsupported_fields_are_refused_by_name():
    with pytest.raises(ModelNotFound, match="model_type 'gpt2'.*supported model_types: gemma2, gemma3_text, llama"):
        architecture(AutoConfig.for_model("gpt2"))
    with pytest.raises(ModelNotFound, match="multimodal Gemma 3.*gemma3_text"):
        architecture(SimpleNamespace(model_type="gemma3"))
    with pytest.raises(UnsupportedModel, match="use_bidirectional_attention"):
        architecture(_config("gemma3", use_bidirectional_attention=True))
    with pytest.raises(UnsupportedModel, match="quantization_config"):
        architecture(_config("llama", quantization_config={"quant_method": "gptq"}))
    bogus = _config("llama")
    bogus.rope_parameters = {"rope_type": "spiral", "rope_theta": 1.0}
    with pytest.raises(UnsupportedModel, match=r"rope_parameters.rope_type: RoPE type 'spiral'"):
        architecture(bogus)
    chunked = _config("qwen3")
    chunked.layer_types = ["full_attention"] * 27 + ["chunked_attention"]
    with pytest.raises(UnsupportedModel, match=r"layer_types\[27\]: attention type 'chunked_attention'"):
        architecture(chunked)


@pytest.mark.unit
def test_longrope_is_served_up_to_its_original_context():
    """Phi-3-mini-128k: LongRoPE switches every position's frequencies past 4096 tokens, which cached keys
    cannot follow; the model is served with the context its short factors cover, and says so."""
    factors = [1.0] * 48
    arch = architecture(_config("phi3", max_position_embeddings=131072, sliding_window=262144,
                                rope_scaling={"type": "longrope", "short_factor": factors, "long_factor": factors}))
    assert arch.max_context == 4096 and arch.rope[""].type == "longrope"
    assert "original_max_position_embeddings=4096" in arch.notes[0]
    assert not arch.sliding  # a 262144-token window is longer than the context: no window at all


@pytest.mark.unit
def test_each_path_runs_the_features_it_implements_and_names_the_others():
    mistral_v01, llama = architecture(_config("mistral")), architecture(_config("llama"))
    assert CUDA_GRAPHS.refusal(llama) is None
    assert "sliding-window attention" in CUDA_GRAPHS.refusal(mistral_v01)
    assert CUDA_GRAPHS.refusal(architecture(_config("mistral", sliding_window=None))) is None  # v0.3
    assert "q/k norms" in CUDA_GRAPHS.refusal(architecture(_config("qwen3")))
    assert kernel_refusal(architecture(_config("llama", head_dim=80))) == "head_dim 80 is not one of 64, 96, 128, 256"
    assert kernel_refusal(architecture(_config("gemma2"))) is None  # head_dim 256, soft-capping, GELU: all in C++


@pytest.mark.unit
def test_partial_rotary_keys_shift_exactly():
    """Phi-4-mini-style partial rotary embeddings: the re-alignment turns the rotated dimensions only."""
    from kvbaton.backend.reuse.rotary import RopeShifter
    from transformers.models.phi3.modeling_phi3 import Phi3RotaryEmbedding, apply_rotary_pos_emb

    config = _config("phi3", hidden_size=256, num_attention_heads=2, num_key_value_heads=2,
                     partial_rotary_factor=0.75)
    rotary = Phi3RotaryEmbedding(config)
    keys = torch.randn(1, 2, 20, 128, generator=torch.Generator().manual_seed(0))

    def at(start: int) -> torch.Tensor:
        cos, sin = rotary(keys, torch.arange(start, start + 20)[None])
        return apply_rotary_pos_emb(keys, keys, cos, sin)[1]

    shifter = RopeShifter(rotary.inv_freq, "default")
    assert rotary.inv_freq.numel() * 2 == 96  # 0.75 of the head rotates
    torch.testing.assert_close(shifter.shift(at(7), 7, 300), at(300), atol=2e-5, rtol=0)


@pytest.mark.unit
def test_every_family_of_the_registry_has_a_tiny_checkpoint_here():
    assert set(TINY) == set(FAMILIES)  # a family added to the registry is tested above, or this fails


@pytest.mark.unit
def test_the_docs_table_is_generated_from_the_registry():
    assert docs.committed(REPO / "docs" / "models.md") == docs.table(), \
        "docs/models.md is stale: run python -m kvbaton.backend.models --docs docs/models.md"


@pytest.mark.unit
def test_the_weights_fingerprint_reads_headers_and_samples_not_every_byte(tmp_path):
    """A first start of a 16 GB checkpoint must not hash 16 GB: the digest covers the safetensors header (every
    tensor's name, dtype, shape), the size and 32 windows of 64 KiB; a copy elsewhere gets the same digest, a
    checkpoint with other values (a fine-tune) another one."""
    from kvbaton.backend.compute.loader import SAMPLE_BYTES, SAMPLES, weights_digest
    from safetensors.torch import save_file

    weights = {"w": torch.randn(1024, 1024, generator=torch.Generator().manual_seed(1))}
    save_file(weights, tmp_path / "a.safetensors")
    (tmp_path / "copy").mkdir()
    save_file(weights, tmp_path / "copy" / "a.safetensors")
    (tmp_path / "tuned").mkdir()
    save_file({"w": weights["w"] + 1e-3}, tmp_path / "tuned" / "a.safetensors")
    digest = weights_digest(tmp_path / "a.safetensors")
    assert weights_digest(tmp_path / "copy" / "a.safetensors") == digest
    assert weights_digest(tmp_path / "tuned" / "a.safetensors") != digest
    assert SAMPLES * SAMPLE_BYTES <= 2 << 20  # what a file costs to read, whatever its size
