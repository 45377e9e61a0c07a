"""Starting a cluster's workers on Ray: the connection, the placement group, one actor per device.

``ray_address`` None starts a private Ray instance on this machine (``kvbaton serve --devices``), never
joining another one that runs there;
an address (``auto``, ``host:6379`` or ``ray://host:10001``) joins a running Ray cluster. The workers
go into one placement group, a bundle per device (``{"GPU": 1, "CPU": 1}`` for a CUDA device, ``{"CPU":
1}`` for a CPU one), ``PACK`` by default (a node's GPUs first, so NCCL stays inside a node where it can)
or as ``placement_strategy`` says (``SPREAD``, ``STRICT_SPREAD``: one worker per node). Ray restarts
an actor that dies (up to ``max_restarts`` times) in its bundle; a bundle of a node that died is
placed again on a node with room, when the cluster has one.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import ray
from kvbaton.errors import InvalidRequest, ServerError
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

if TYPE_CHECKING:
    from .moves import Group
    from .remote import WorkerRef

log = logging.getLogger(__name__)

NAMESPACE = "kvbaton"
DEFAULT_MAX_RESTARTS = 16
STRATEGIES = ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD")


def connect(ray_address: str | None, devices: Sequence[str]) -> bool:
    """Connect this process to Ray (a private local instance when ``ray_address`` is None); whether
    it started Ray here (and so shuts it down at close). A process already connected stays so."""
    if ray.is_initialized():
        return False
    # Ray starts its worker processes at niceness 15 by default: serving workers are the work here.
    os.environ.setdefault("RAY_worker_niceness", "0")
    quiet = {"include_dashboard": False, "logging_level": logging.WARNING, "log_to_driver": False,
             "configure_logging": False}
    if ray_address:
        ray.init(address=ray_address, namespace=NAMESPACE, **({} if ray_address.startswith("ray://") else quiet))
        return True
    cpus = sum(1 for d in devices if not d.startswith("cuda"))
    gpus = sum(1 for d in devices if d.startswith("cuda"))
    # Logical resources: a bundle per device, whatever the core count (the workers share the cores).
    # "local": a private instance even where another Ray runs on this machine (with no address, Ray
    # would join the newest cluster it finds in /tmp/ray, and refuse the resources asked for here).
    ray.init(address="local", num_cpus=max(os.cpu_count() or 1, cpus + gpus), num_gpus=gpus or None,
             namespace=NAMESPACE, **quiet)
    return True


def bundle(device: str, gpu_share: float = 1.0) -> dict[str, float]:
    return {"GPU": gpu_share, "CPU": 1.0} if device.startswith("cuda") else {"CPU": 1.0}


def reserve(devices: Sequence[str], strategy: str, timeout: float, gpu_share: float = 1.0) -> PlacementGroup:
    """A placement group of one bundle per device, ready (``ServerError`` when the cluster has no room
    for it within ``timeout`` seconds: it says what was asked)."""
    if strategy not in STRATEGIES:
        raise InvalidRequest(f"placement strategy must be one of {', '.join(STRATEGIES)}, got {strategy!r}")
    bundles = [bundle(d, gpu_share) for d in devices]
    pg = placement_group(bundles, strategy=strategy, name="")
    ready, _ = ray.wait([pg.ready()], timeout=timeout)
    if not ready:
        remove_placement_group(pg)
        raise ServerError(f"the Ray cluster has no room for {len(bundles)} workers {bundles} ({strategy}) after "
                          f"{timeout:.0f} s; its resources: {ray.cluster_resources()}")
    return pg


def start_worker(worker_cls: Any, pg: PlacementGroup, index: int, device: str, *, args: tuple[Any, ...],
                 threads: int | None, max_restarts: int, gpu_share: float = 1.0) -> Any:
    """The actor of worker ``index`` in its bundle (Ray restarts it when it dies)."""
    return worker_cls.options(
        num_cpus=1, num_gpus=gpu_share if device.startswith("cuda") else 0,
        max_restarts=max_restarts, max_task_retries=0,
        scheduling_strategy=PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=index),
        runtime_env=runtime_env(threads),
    ).remote(*args)


def runtime_env(threads: int | None) -> dict[str, Any] | None:
    """An actor's environment: where this process keeps its caches and model, and ``threads`` for torch."""
    env = {"OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)} if threads else {}
    for key in ("KVBATON_CACHE_DIR", "HF_HOME", "HF_HUB_OFFLINE", "KVBATON_RECALIBRATE"):
        if key in os.environ:
            env.setdefault(key, os.environ[key])
    return {"env_vars": env} if env else None


def form_group(workers: Sequence[WorkerRef], devices: Sequence[str], transport: str) -> Group | None:
    """The torch.distributed group inside the actors (as vLLM's Ray executor forms its own), when
    ``transport`` asks for one (``auto``: NCCL between workers with a GPU each; ``collective``: also
    gloo); None: KV moves through the object store."""
    from .moves import Group
    from .remote import answer
    from .worker import DIST_BACKEND_ENV, default_backend

    backend = os.environ.get(DIST_BACKEND_ENV) or default_backend(list(devices))
    if len(workers) < 2 or transport == "object-store" or (transport == "auto" and backend != "nccl"):
        return None
    address = ray.get(workers[0].actor.group_address.remote())
    for reply in ray.get([w.actor.join_group.remote(backend, address, w.rank, len(workers)) for w in workers]):
        answer(reply)
    return Group(backend, {w.rank for w in workers})


def stop(actors: Sequence[Any], pg: PlacementGroup | None, started_ray: bool) -> None:
    for actor in actors:
        try:
            ray.kill(actor, no_restart=True)
        except Exception:  # noqa: BLE001 - already gone
            pass
    if pg is not None:
        try:
            remove_placement_group(pg)
        except Exception:  # noqa: BLE001
            pass
    if started_ray and ray.is_initialized():
        ray.shutdown()
