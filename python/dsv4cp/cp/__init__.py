"""Model-independent context parallelism: token layout, collectives, order guard, launchers."""

from __future__ import annotations

from dsv4cp.cp.dist import TorchDistCPGroup, new_cp_group
from dsv4cp.cp.fake import FakeCPGroup, FakeCPWorld, run_ranks
from dsv4cp.cp.group import (
    CPCommError,
    CPGroup,
    CPRankFailedError,
    CPTimeoutError,
    SingleCPGroup,
    gather_global,
    gather_indexed,
)
from dsv4cp.cp.guard import CPOrderError, debug_cp_enabled
from dsv4cp.cp.launch import CPLaunchError, run_cp, spawn_ranks
from dsv4cp.cp.layout import CPLayout

__all__ = [
    "CPCommError",
    "CPGroup",
    "CPLaunchError",
    "CPLayout",
    "CPOrderError",
    "CPRankFailedError",
    "CPTimeoutError",
    "FakeCPGroup",
    "FakeCPWorld",
    "SingleCPGroup",
    "TorchDistCPGroup",
    "debug_cp_enabled",
    "gather_global",
    "gather_indexed",
    "new_cp_group",
    "run_cp",
    "run_ranks",
    "spawn_ranks",
]
