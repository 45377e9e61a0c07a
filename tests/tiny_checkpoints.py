"""Tiny random-weight checkpoints of every model family, written as real releases ship them.

Each starts from the family's release config (``Family.release_config``: a published model's config.json) with
its sizes shrunk (2 layers, hidden 64-192) and its sliding windows shortened so that a prompt of a few dozen
tokens is longer than any window. The directory holds what a downloaded checkpoint holds: ``config.json``,
safetensors weights (sharded with an index file, or in bf16, where the spec says so), ``generation_config.json``
with an EOS list and sampling defaults, and a tokenizer with the family's chat template (SmolLM2's tokenizer,
already on disk for the default model, with the template swapped).
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

TEMPLATES = {
    "gemma": ("{{ bos_token }}{% for m in messages %}<start_of_turn>{{ 'model' if m['role'] == 'assistant' "
              "else m['role'] }}\n{{ m['content'] }}<end_of_turn>\n{% endfor %}{% if add_generation_prompt %}"
              "<start_of_turn>model\n{% endif %}"),
    "phi3": ("{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}<|end|>\n{% endfor %}"
             "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"),
}


@dataclass
class Tiny:
    """How one family's tiny checkpoint differs from its release config."""

    family: str
    shrink: dict[str, Any]
    template: str | None = None  # a TEMPLATES key; None keeps SmolLM2's ChatML
    shards: bool = False  # several safetensors files and an index
    bf16: bool = False  # weights stored in bfloat16
    tags: dict[str, Any] = field(default_factory=dict)


SMALL = {"num_hidden_layers": 2, "vocab_size": 49152, "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 2,
         "initializer_range": 0.1, "tie_word_embeddings": False}
TINY = {
    # head_dim 64 (kvbaton's kernels), llama3 RoPE, tied embeddings, sharded
    "llama": Tiny("llama", {"hidden_size": 128, "intermediate_size": 256, "num_attention_heads": 2,
                            "num_key_value_heads": 1, "head_dim": 64, "max_position_embeddings": 16384,
                            "tie_word_embeddings": True}, shards=True),
    # q/k/v biases, sliding windows on the layers from max_window_layers on (use_sliding_window), bf16 on disk
    "qwen2": Tiny("qwen2", {"hidden_size": 128, "intermediate_size": 192, "num_attention_heads": 2,
                            "num_key_value_heads": 1, "use_sliding_window": True, "sliding_window": 16,
                            "max_window_layers": 1, "max_position_embeddings": 2048}, bf16=True),
    # q/k norms, head_dim 128 independent of hidden_size
    "qwen3": Tiny("qwen3", {"hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 2,
                            "num_key_value_heads": 1, "head_dim": 128, "max_position_embeddings": 2048}),
    # a window on every layer; head_dim 16: the generic path (no kvbaton kernel for it)
    "mistral": Tiny("mistral", {"hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4,
                                "num_key_value_heads": 2, "sliding_window": 16, "max_position_embeddings": 2048}),
    # fused qkv / gate_up weights, a window on every layer, head_dim 96
    "phi3": Tiny("phi3", {"hidden_size": 192, "intermediate_size": 128, "num_attention_heads": 2,
                          "num_key_value_heads": 2, "sliding_window": 20, "original_max_position_embeddings": 2048,
                          "max_position_embeddings": 2048}, template="phi3"),
    # head_dim 256, soft-capping, sandwich norms, (1 + w) norms, GELU, alternating windows
    "gemma2": Tiny("gemma2", {"hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 2,
                              "num_key_value_heads": 1, "head_dim": 256, "sliding_window": 16,
                              "max_position_embeddings": 2048, "query_pre_attn_scalar": 64,
                              "attn_logit_softcapping": 5.0, "final_logit_softcapping": 3.0}, template="gemma"),
    # q/k norms, two rotary tables; sliding_window_pattern 2 so that 2 layers hold one of each kind
    "gemma3": Tiny("gemma3", {"hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 2,
                              "num_key_value_heads": 1, "head_dim": 64, "sliding_window": 12,
                              "sliding_window_pattern": 2, "max_position_embeddings": 2048,
                              "query_pre_attn_scalar": 64}, template="gemma", shards=True, bf16=True),
}
GENERATION = {"do_sample": True, "temperature": 0.6, "top_p": 0.95, "top_k": 20, "eos_token_id": [2, 0],
              "bos_token_id": 1, "pad_token_id": 2}


def config_of(family: str) -> dict[str, Any]:
    from kvbaton.backend.models import FAMILIES

    return {**FAMILIES[family].release_config, **SMALL, **TINY[family].shrink}


def tokenizer_source() -> Path:
    from kvbaton.backend.compute.loader import convert_default_model

    return convert_default_model()


def build(family: str, root: Path, seed: int = 0) -> Path:
    """Write the tiny checkpoint of ``family`` under ``root`` and return its directory."""
    from transformers import AutoConfig, AutoModelForCausalLM

    spec = TINY[family]
    out = root / family
    if (out / "config.json").is_file():
        return out
    cfg = dict(config_of(family))
    model_type = cfg.pop("model_type")
    config = AutoConfig.for_model(model_type, **cfg)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:  # random norm weights: a wrong norm formula shows
                p.copy_(torch.randn_like(p) * 0.3 + (0.0 if "gemma" in family else 1.0))
            elif "bias" in name:
                p.copy_(torch.randn_like(p) * 0.5)
    if spec.bf16:
        model = model.to(torch.bfloat16)
    out.mkdir(parents=True)
    model.save_pretrained(out, max_shard_size="1MB" if spec.shards else "2GB")
    # the release's own config.json fields (not transformers' re-serialisation) are what users' directories hold
    (out / "config.json").write_text(json.dumps({**config_of(family), "torch_dtype": "bfloat16" if spec.bf16
                                                 else "float32"}, indent=2))
    (out / "generation_config.json").write_text(json.dumps(GENERATION, indent=2))
    source = tokenizer_source()
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (source / name).is_file():
            shutil.copy(source / name, out / name)
    if spec.template is not None:
        (out / "chat_template.jinja").write_text(TEMPLATES[spec.template])
    return out
