"""Re-aligning cached keys to new positions (RoPE shift).

RoPE rotates each pair of key dimensions by ``position * inv_freq``; rotations compose, so a key
cached at position ``p`` moves to ``p + d`` by one more rotation, and values do not change. This is
exact only when the angle depends on the position alone: plain RoPE, linear scaling and llama3-type
scaling. Dynamic NTK changes ``inv_freq`` with the sequence length, and YaRN / LongRoPE scale cos/sin
by an attention factor (LongRoPE also switches frequencies with the length): for those a shift would be
an approximation, so :func:`check_shiftable` refuses them. A model whose layers rotate with different tables
(Gemma 3: local and global layers) is refused too: a shift turns every layer's keys by one table. Partial
rotary embeddings (Phi-4-mini) turn the rotated part of each key and leave the rest. Every refusal has its
reason (:attr:`RopeShifter.reason`): placement recomputes such a segment densely and says why.

To match dense prefill to the last bit that matters, the shift angle is the difference of the two fp32
angles the model itself computes (``fp32(inv_freq * p)``), taken in float64: a plain ``d * inv_freq``
would differ from the model's own rounding by up to ~5e-4 rad at a few thousand tokens.
"""

from __future__ import annotations

from typing import Any

import torch
from kvbaton.errors import UnsupportedPositions

from ..models.spec import SHIFTABLE_ROPE

SHIFTABLE_ROPE_TYPES = SHIFTABLE_ROPE  # the registry's (kvbaton.backend.models.spec)


def check_shiftable(rope_type: str, rope_parameters: dict[str, Any] | None = None) -> None:
    """Raise :class:`UnsupportedPositions` unless keys of this RoPE variant can be shifted exactly."""
    if rope_type not in SHIFTABLE_ROPE_TYPES:
        raise UnsupportedPositions(
            f"RoPE type {rope_type!r} cannot be shifted exactly (its cos/sin depend on the sequence length or "
            f"carry an attention scaling factor); only {sorted(SHIFTABLE_ROPE_TYPES)} can be re-aligned, "
            "so this segment has to be recomputed"
        )
    factor = (rope_parameters or {}).get("attention_factor")
    if factor not in (None, 1, 1.0):
        raise UnsupportedPositions(f"RoPE with attention_factor={factor} cannot be shifted exactly")


class RopeShifter:
    """Moves post-RoPE keys of one model between positions."""

    def __init__(self, inv_freq: torch.Tensor, rope_type: str, rope_parameters: dict[str, Any] | None = None,
                 refusal: str | None = None) -> None:
        self.rope_type = rope_type
        self.rope_parameters = dict(rope_parameters or {})
        self.inv_freq = inv_freq.detach().float().cpu()
        self._refusal = refusal  # a reason beyond the RoPE variant (per-layer tables)

    @classmethod
    def from_model(cls, model: Any, rope_type: str, rope_parameters: dict[str, Any] | None = None) -> RopeShifter:
        from ..models import architecture_of
        from ..models import modules as model_modules
        from ..models.paths import SHIFT

        arch = architecture_of(model)
        refusal = SHIFT.refusal(arch)  # the RoPE variant itself is checked by check_shiftable, as for any caller
        group = arch.layer_rope[0]
        rotary = model.model.rotary_emb
        scaling = float(getattr(rotary, f"{group}_attention_scaling" if group else "attention_scaling", 1.0))
        params = dict(rope_parameters or {})
        if scaling != 1.0:
            params.setdefault("attention_factor", scaling)
        if refusal is not None:
            refusal = f"{refusal} ({rope_type}): the segment is recomputed"
        return cls(model_modules.inv_freq(model, arch, group), rope_type, params, refusal)

    @property
    def reason(self) -> str | None:
        """Why keys of this model cannot be re-aligned exactly (None: they can)."""
        if self._refusal is not None:
            return self._refusal
        try:
            check_shiftable(self.rope_type, self.rope_parameters)
        except UnsupportedPositions as exc:
            return str(exc)
        return None

    def shiftable(self) -> bool:
        return self.reason is None

    def _check(self) -> None:
        reason = self.reason
        if reason is not None:
            raise UnsupportedPositions(reason)

    def shift(self, keys: torch.Tensor, old_start: int, new_start: int) -> torch.Tensor:
        """Keys ``[..., tokens, head_dim]`` cached at positions ``old_start..`` moved to ``new_start..``."""
        self._check()
        n = keys.shape[-2]
        if old_start == new_start or n == 0:
            return keys
        return self.rotation(old_start, new_start, n, keys.device)(keys)

    def rotation(self, old_start: int, new_start: int, n: int, device: torch.device | str = "cpu") -> Rotation:
        """The shift of ``n`` keys from ``old_start..`` to ``new_start..``, its angles computed once: moving a
        long segment layer by layer (:meth:`KVManager.move_rows`) applies it to one layer at a time."""
        self._check()
        inv = self.inv_freq.to(device)
        old = torch.arange(old_start, old_start + n, device=device, dtype=torch.float32)
        new = torch.arange(new_start, new_start + n, device=device, dtype=torch.float32)
        delta = (new[:, None] * inv[None, :]).double() - (old[:, None] * inv[None, :]).double()
        return Rotation(delta.cos().to(torch.float32), delta.sin().to(torch.float32), identity=old_start == new_start)


class Rotation:
    """Turns keys ``[..., tokens, head_dim]`` by fixed per-token angles (:meth:`RopeShifter.rotation`)."""

    def __init__(self, cos: torch.Tensor, sin: torch.Tensor, identity: bool = False) -> None:
        self.cos, self.sin, self.identity = cos, sin, identity

    def __call__(self, keys: torch.Tensor) -> torch.Tensor:
        if self.identity:
            return keys
        n = keys.shape[-2]
        cos, sin = self.cos, self.sin
        # The model lays out cos/sin as [delta, delta] over head_dim, so each half of a key turns by the
        # same [tokens, head_dim / 2] angles: k1' = k1 cos - k2 sin, k2' = k2 cos + k1 sin (the same
        # products and sums as k * cos + rotate_half(k) * sin, so the same bits), a few heads at a time
        # and without the rotate_half copy: the keys of a long segment are tens of MB. With partial rotary
        # embeddings only the first 2 * len(angles) dimensions turn; the rest are copied.
        half = cos.shape[-1]
        rotated = 2 * half
        out = torch.empty(keys.shape, dtype=torch.float32, device=keys.device)
        flat_in, flat_out = keys.reshape(-1, n, keys.shape[-1]), out.view(-1, n, keys.shape[-1])
        step = max(1, (1 << 19) // max(1, n * keys.shape[-1]))  # ~2 MB of keys per pass: stays in cache
        for i in range(0, flat_in.shape[0], step):
            k = flat_in[i : i + step].float()
            k1, k2 = k[..., :half], k[..., half:rotated]
            o1, o2 = flat_out[i : i + step, :, :half], flat_out[i : i + step, :, half:rotated]
            torch.mul(k1, cos, out=o1).sub_(k2 * sin)
            torch.mul(k2, cos, out=o2).add_(k1 * sin)
            if rotated < keys.shape[-1]:
                flat_out[i : i + step, :, rotated:] = k[..., rotated:]
        return out.to(keys.dtype)
