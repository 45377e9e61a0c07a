"""kvbaton's sizes in SGLang's units: its KV pool is sized in tokens, its host tier in whole gigabytes."""

from __future__ import annotations

import re
from typing import Any

from kvbaton.errors import InvalidRequest

_BUDGET = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(tokens?|[KMGT]i?B|B)?\s*$", re.IGNORECASE)
_UNITS = {"b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def kv_tokens_for_budget(budget: str | int, config: dict[str, Any], dtype_bytes: int = 2) -> int:
    """SGLang sizes its KV pool in tokens: ``"4096 tokens"``, or a byte size for this model's KV."""
    if isinstance(budget, int):
        return budget
    match = _BUDGET.match(budget)
    if match is None:
        raise InvalidRequest(f'kv budget {budget!r}: use "N tokens" or a size such as "512MiB"')
    value, unit = float(match.group(1)), (match.group(2) or "tokens").lower()
    if unit.startswith("token"):
        return int(value)
    try:
        layers = config["num_hidden_layers"]
        kv_heads = config.get("num_key_value_heads", config["num_attention_heads"])
        head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    except KeyError as exc:
        raise InvalidRequest(f"cannot size KV in bytes for this model config ({exc}); give \"N tokens\"") from exc
    per_token = 2 * layers * kv_heads * head_dim * dtype_bytes
    return max(1, int(value * _UNITS[unit]) // per_token)


def gigabytes(size: str) -> int:
    """SGLang sizes its host tier in whole gigabytes: ``"8GiB"`` -> 8 (rounded up)."""
    match = _BUDGET.match(size)
    unit = (match.group(2) or "").lower() if match else ""
    if match is None or unit not in _UNITS:
        raise InvalidRequest(f'host tier size {size!r}: use a size such as "8GiB"')
    return max(1, -(-int(float(match.group(1)) * _UNITS[unit]) // 10**9))
