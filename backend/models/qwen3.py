"""Qwen3 (dense): the Llama layer with an RMSNorm on every query and key head before RoPE (q_norm / k_norm),
an explicit head_dim, optional attention biases, and Qwen2's optional sliding windows."""

from __future__ import annotations

from .spec import Family, Layout


class Qwen3(Family):
    name = "qwen3"
    model_types = ("qwen3",)
    classes = ("Qwen3ForCausalLM",)
    releases = "Qwen3 0.6B-32B (dense)"
    layout = Layout(q_norm="q_norm", k_norm="k_norm")
    release_config = {  # Qwen/Qwen3-0.6B
        "architectures": ["Qwen3ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
        "bos_token_id": 151643, "eos_token_id": 151645, "head_dim": 128, "hidden_act": "silu", "hidden_size": 1024,
        "initializer_range": 0.02, "intermediate_size": 3072, "max_position_embeddings": 40960,
        "max_window_layers": 28, "model_type": "qwen3", "num_attention_heads": 16, "num_hidden_layers": 28,
        "num_key_value_heads": 8, "rms_norm_eps": 1e-06, "rope_scaling": None, "rope_theta": 1000000,
        "sliding_window": None, "tie_word_embeddings": True, "torch_dtype": "bfloat16", "use_cache": True,
        "use_sliding_window": False, "vocab_size": 151936,
    }


FAMILY = Qwen3()
