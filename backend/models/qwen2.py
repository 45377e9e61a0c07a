"""Qwen2 / Qwen2.5: the Llama layer with q/k/v biases; sliding windows on the layers from max_window_layers on
when ``use_sliding_window`` is set (transformers' ``layer_types``)."""

from __future__ import annotations

from typing import Any

from .spec import Family


class Qwen2(Family):
    name = "qwen2"
    model_types = ("qwen2",)
    classes = ("Qwen2ForCausalLM",)
    releases = "Qwen2, Qwen2.5 (incl. Coder / Math; YaRN rope_scaling for long contexts)"
    release_config = {  # Qwen/Qwen2.5-0.5B-Instruct
        "architectures": ["Qwen2ForCausalLM"], "attention_dropout": 0.0, "bos_token_id": 151643,
        "eos_token_id": 151645, "hidden_act": "silu", "hidden_size": 896, "initializer_range": 0.02,
        "intermediate_size": 4864, "max_position_embeddings": 32768, "max_window_layers": 21, "model_type": "qwen2",
        "num_attention_heads": 14, "num_hidden_layers": 24, "num_key_value_heads": 2, "rms_norm_eps": 1e-06,
        "rope_theta": 1000000.0, "sliding_window": 32768, "tie_word_embeddings": True, "torch_dtype": "bfloat16",
        "use_cache": True, "use_sliding_window": False, "vocab_size": 151936,
    }

    def biases(self, config: Any) -> tuple[bool, bool, bool]:
        return True, False, False


FAMILY = Qwen2()
