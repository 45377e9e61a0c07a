"""Multi-device serving: a coordinator over one worker process per device.

Start-up (rendezvous, calibration), routing (placement), moving handles between workers (transfer or
recompute, as the cost model says; KV over torch.distributed) and failover of streams.
"""

from __future__ import annotations

from typing import Any

__all__ = ["Cluster"]


def __getattr__(name: str) -> Any:
    # Lazy: the worker processes import their own modules without the coordinator's.
    if name == "Cluster":
        from .coordinator import Cluster

        return Cluster
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
