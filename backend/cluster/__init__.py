"""Multi-device and multi-node serving on Ray: an ingress over one worker actor per device.

Start-up (:mod:`.launch`: Ray, placement group, actors), routing (:mod:`.routing`,
:mod:`.placement`), moving handles between workers (:mod:`.moves`: transfer or recompute, as the
cost model says; KV over a collective group or Ray's object store, :mod:`.transfer`), streams that
outlive their worker (:mod:`.streams`) and workers that Ray restarts (:mod:`.liveness`).
"""

from __future__ import annotations

from typing import Any

__all__ = ["Cluster"]


def __getattr__(name: str) -> Any:
    # Lazy: importing the package must not import Ray for code that never starts a cluster.
    if name == "Cluster":
        from .coordinator import Cluster

        return Cluster
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
