"""Mistral: the Llama layer; ``sliding_window`` (v0.1: 4096) bounds every layer's attention."""

from __future__ import annotations

from typing import Any

from .spec import Family


class Mistral(Family):
    name = "mistral"
    model_types = ("mistral",)
    classes = ("MistralForCausalLM",)
    releases = "Mistral 7B v0.1 (sliding window 4096) / v0.2 / v0.3, Mistral Nemo"
    release_config = {  # mistralai/Mistral-7B-v0.1
        "architectures": ["MistralForCausalLM"], "bos_token_id": 1, "eos_token_id": 2, "hidden_act": "silu",
        "hidden_size": 4096, "initializer_range": 0.02, "intermediate_size": 14336, "max_position_embeddings": 32768,
        "model_type": "mistral", "num_attention_heads": 32, "num_hidden_layers": 32, "num_key_value_heads": 8,
        "rms_norm_eps": 1e-05, "rope_theta": 10000.0, "sliding_window": 4096, "tie_word_embeddings": False,
        "torch_dtype": "bfloat16", "use_cache": True, "vocab_size": 32000,
    }

    def windows(self, config: Any) -> list[int | None]:
        window = getattr(config, "sliding_window", None)  # transformers' Mistral: every layer, or none
        return [int(window) if window else None] * int(config.num_hidden_layers)


FAMILY = Mistral()
