"""Gemma 3 (text; ``gemma3_text``: Gemma-3-1B and the text model of larger Gemma-3 checkpoints saved as such):
Gemma 2's layer without soft-capping, with q/k norms, sliding-window layers (512-1024) five to one global, and
two rotary tables: the local layers' (theta 10k) and the global layers' (theta 1M, linear scaling on 4B+)."""

from __future__ import annotations

from dataclasses import replace

from .gemma2 import GEMMA_LAYOUT, Gemma2


class Gemma3(Gemma2):
    name = "gemma3"
    model_types = ("gemma3_text",)
    classes = ("Gemma3ForCausalLM",)
    releases = "Gemma 3 1B (gemma3_text); the multimodal 4B-27B checkpoints (model_type gemma3) are refused"
    layout = replace(GEMMA_LAYOUT, q_norm="q_norm", k_norm="k_norm")
    # Bidirectional attention (an embedding-model option) is not causal decoding.
    fixed_fields = {"use_bidirectional_attention": (False, None)}
    release_config = {  # google/gemma-3-1b-it
        "architectures": ["Gemma3ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
        "attn_logit_softcapping": None, "bos_token_id": 2, "cache_implementation": "hybrid", "eos_token_id": [1, 106],
        "final_logit_softcapping": None, "head_dim": 256, "hidden_activation": "gelu_pytorch_tanh",
        "hidden_size": 1152, "initializer_range": 0.02, "intermediate_size": 6912, "max_position_embeddings": 32768,
        "model_type": "gemma3_text", "num_attention_heads": 4, "num_hidden_layers": 26, "num_key_value_heads": 1,
        "pad_token_id": 0, "query_pre_attn_scalar": 256, "rms_norm_eps": 1e-06, "rope_local_base_freq": 10000,
        "rope_scaling": None, "rope_theta": 1000000, "sliding_window": 512, "sliding_window_pattern": 6,
        "torch_dtype": "bfloat16", "use_cache": True, "vocab_size": 262144,
    }


FAMILY = Gemma3()
