"""Phi-3 / Phi-3.5 / Phi-4-mini: the Llama layer with q/k/v and gate/up each stored as one fused matrix
(``qkv_proj``, ``gate_up_proj``), a sliding window on every layer (Phi-3-mini-4k: 2047), LongRoPE for the long
context releases (served up to original_max_position_embeddings, see ``spec``) and partial rotary embeddings."""

from __future__ import annotations

from typing import Any

from .spec import Family, Layout


class Phi3(Family):
    name = "phi3"
    model_types = ("phi3",)
    classes = ("Phi3ForCausalLM",)
    releases = "Phi-3-mini / medium (4k, 128k), Phi-3.5-mini, Phi-4-mini"
    layout = Layout(qkv=("qkv_proj",), gate_up=("gate_up_proj",))
    release_config = {  # microsoft/Phi-3-mini-4k-instruct
        "architectures": ["Phi3ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0, "bos_token_id": 1,
        "embd_pdrop": 0.0, "eos_token_id": 32000, "hidden_act": "silu", "hidden_size": 3072,
        "initializer_range": 0.02, "intermediate_size": 8192, "max_position_embeddings": 4096, "model_type": "phi3",
        "num_attention_heads": 32, "num_hidden_layers": 32, "num_key_value_heads": 32,
        "original_max_position_embeddings": 4096, "pad_token_id": 32000, "resid_pdrop": 0.0, "rms_norm_eps": 1e-05,
        "rope_scaling": None, "rope_theta": 10000.0, "sliding_window": 2047, "tie_word_embeddings": False,
        "torch_dtype": "bfloat16", "use_cache": True, "vocab_size": 32064,
    }

    def windows(self, config: Any) -> list[int | None]:
        window = getattr(config, "sliding_window", None)  # transformers' Phi-3: every layer, or none
        return [int(window) if window else None] * int(config.num_hidden_layers)

    def biases(self, config: Any) -> tuple[bool, bool, bool]:
        return False, False, False  # transformers' Phi-3 builds qkv_proj and o_proj without biases


FAMILY = Phi3()
