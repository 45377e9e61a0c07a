"""kvbaton's directories on this machine: the cache root, under which models are converted, kernels
built, disk tiers kept and calibrations remembered. A leaf: every layer may import it."""

from __future__ import annotations

import os
from pathlib import Path

from platformdirs import user_cache_dir


def cache_dir() -> Path:
    """kvbaton's cache root: ``$KVBATON_CACHE_DIR`` or the platform's user cache dir."""
    return Path(os.environ.get("KVBATON_CACHE_DIR") or user_cache_dir("kvbaton"))
