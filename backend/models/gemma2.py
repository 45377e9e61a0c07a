"""Gemma 2: RMSNorms that scale by ``1 + weight``, a norm before and after both attention and MLP (sandwich),
GELU (tanh) gating, embeddings scaled by sqrt(hidden_size), queries scaled by query_pre_attn_scalar ** -0.5,
attention scores and final logits soft-capped (``cap * tanh(x / cap)``), and sliding-window layers (4096)
alternating with global ones."""

from __future__ import annotations

from typing import Any

from .spec import Family, Layout

GEMMA_LAYOUT = Layout(attn_out_norm="post_attention_layernorm", mlp_norm="pre_feedforward_layernorm",
                      mlp_out_norm="post_feedforward_layernorm")


class Gemma2(Family):
    name = "gemma2"
    model_types = ("gemma2",)
    classes = ("Gemma2ForCausalLM",)
    releases = "Gemma 2 2B / 9B / 27B"
    layout = GEMMA_LAYOUT
    release_config = {  # google/gemma-2-2b-it
        "architectures": ["Gemma2ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
        "attn_logit_softcapping": 50.0, "bos_token_id": 2, "cache_implementation": "hybrid", "eos_token_id": [1, 107],
        "final_logit_softcapping": 30.0, "head_dim": 256, "hidden_act": "gelu_pytorch_tanh",
        "hidden_activation": "gelu_pytorch_tanh", "hidden_size": 2304, "initializer_range": 0.02,
        "intermediate_size": 9216, "max_position_embeddings": 8192, "model_type": "gemma2", "num_attention_heads": 8,
        "num_hidden_layers": 26, "num_key_value_heads": 4, "pad_token_id": 0, "query_pre_attn_scalar": 256,
        "rms_norm_eps": 1e-06, "rope_theta": 10000.0, "sliding_window": 4096, "torch_dtype": "float32",
        "use_cache": True, "vocab_size": 256000,
    }

    def activation(self, config: Any) -> str:
        return str(getattr(config, "hidden_activation", None) or getattr(config, "hidden_act", "gelu_pytorch_tanh"))

    def query_scale(self, config: Any, head_dim: int) -> float:
        return float(config.query_pre_attn_scalar) ** -0.5

    def embed_scale(self, config: Any) -> float | None:
        return float(config.hidden_size) ** 0.5

    def norm_offset(self) -> float:
        return 1.0


FAMILY = Gemma2()
