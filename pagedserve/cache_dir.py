"""Where pagedserve keeps what it derives once and reuses: converted GGUF checkpoints, built CPU kernels."""

from __future__ import annotations

import os
from pathlib import Path


def cache_root() -> Path:
    """`$PAGEDSERVE_CACHE_DIR`, else `~/.cache/pagedserve`."""
    env = os.environ.get("PAGEDSERVE_CACHE_DIR")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "pagedserve"
