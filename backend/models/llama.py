"""Llama (Llama 2/3.x, SmolLM, TinyLlama, ...): the reference decoder layer every other family differs from.

Pre-norm attention with grouped K/V heads and a SiLU-gated MLP, RMSNorm, optional attention and MLP biases,
RoPE default / linear / llama3 / dynamic / YaRN.
"""

from __future__ import annotations

from .spec import Family


class Llama(Family):
    name = "llama"
    model_types = ("llama",)
    classes = ("LlamaForCausalLM",)
    releases = "Llama 3.1 / 3.2, SmolLM2 (kvbaton's default model), TinyLlama"
    release_config = {  # meta-llama/Llama-3.2-1B-Instruct
        "architectures": ["LlamaForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
        "bos_token_id": 128000, "eos_token_id": [128001, 128008, 128009], "head_dim": 64, "hidden_act": "silu",
        "hidden_size": 2048, "initializer_range": 0.02, "intermediate_size": 8192, "max_position_embeddings": 131072,
        "mlp_bias": False, "model_type": "llama", "num_attention_heads": 32, "num_hidden_layers": 16,
        "num_key_value_heads": 8, "pretraining_tp": 1, "rms_norm_eps": 1e-05,
        "rope_scaling": {"factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                         "original_max_position_embeddings": 8192, "rope_type": "llama3"},
        "rope_theta": 500000.0, "tie_word_embeddings": True, "torch_dtype": "bfloat16", "use_cache": True,
        "vocab_size": 128256,
    }


FAMILY = Llama()
