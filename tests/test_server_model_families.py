"""``kvbaton serve --model DIR`` with a checkpoint of another family (Gemma 2: soft-capping, sliding windows,
its own chat template): the server prompts with the checkpoint's template and decodes exactly as
transformers does on the same weights."""

from __future__ import annotations

import kvbaton
import pytest
import torch
from server_fixtures import ServerProcess
from tiny_checkpoints import build
from transformers import AutoModelForCausalLM, AutoTokenizer

MESSAGES = [{"role": "user", "content": "Summarize: agents pass handles to each other instead of text. " * 3}]


@pytest.fixture(scope="module")
def gemma(tmp_path_factory: pytest.TempPathFactory):
    directory = build("gemma2", tmp_path_factory.mktemp("checkpoints"))
    server = ServerProcess(["--model", str(directory), "--kv-budget", "16MiB"]).start()
    yield directory, server
    server.stop()


def test_a_gemma2_checkpoint_is_served_with_its_chat_template_and_transformers_tokens(gemma):
    directory, server = gemma
    tokenizer = AutoTokenizer.from_pretrained(directory)
    prompt = tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=True, return_dict=False)
    reference = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32, attn_implementation="eager")
    with torch.inference_mode():
        expected = reference.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False, eos_token_id=None,
                                      pad_token_id=0)[0, len(prompt):].tolist()
    assert len(prompt) > reference.config.sliding_window  # the window binds
    with server.http() as http:
        assert http.get("/v1/models").json()["data"][0]["id"] == directory.name
    with kvbaton.connect(server.url, timeout=120) as client:
        assert client.chat_tokens(MESSAGES) == list(prompt)
        assert "<start_of_turn>user" in tokenizer.decode(prompt)
        result = client.generate(MESSAGES, max_tokens=8, temperature=0.0, ignore_eos=True)
        assert result.token_ids == expected and result.exact
