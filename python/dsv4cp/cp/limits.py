"""How many CP ranks each backend can run on this machine, checked before anything starts.

- gloo: one process per rank (a torch interpreter each, ~0.5 GB): at most `GLOO_RANKS_PER_CPU`
  per CPU core;
- nccl: one process per rank and one visible GPU per rank;
- fake: one thread per rank in this process (each with its own OpenMP team on CPU, its own side
  streams on CUDA): at most `FAKE_MAX_RANKS`.

`DSV4CP_MAX_CP_RANKS=N` raises (or lowers) the gloo and fake bounds; the GPU count of NCCL is a
hard limit.
"""

from __future__ import annotations

import os
from typing import cast

import torch

from dsv4cp import env_vars

__all__ = ["FAKE_MAX_RANKS", "GLOO_RANKS_PER_CPU", "MAX_RANKS_ENV", "check_cp_limit", "cp_limit"]

GLOO_RANKS_PER_CPU = 4
FAKE_MAX_RANKS = 64
MAX_RANKS_ENV = "DSV4CP_MAX_CP_RANKS"


def _env_override() -> int | None:
    return cast(int | None, env_vars.read(MAX_RANKS_ENV))


def cp_limit(backend: str) -> tuple[int, str]:
    """(the largest cp_size `backend` may start here, why that number)."""
    if backend == "nccl":
        n = torch.cuda.device_count()
        return n, f"NCCL runs one rank per GPU and {n} GPUs are visible"
    override = _env_override()
    if backend == "gloo":
        cpus = os.cpu_count() or 1
        if override is not None:
            return override, f"{MAX_RANKS_ENV}={override}"
        return (
            GLOO_RANKS_PER_CPU * cpus,
            f"gloo runs one process per rank, at most {GLOO_RANKS_PER_CPU} per CPU core "
            f"({cpus} cores); set {MAX_RANKS_ENV} to change the bound",
        )
    if backend == "fake":
        if override is not None:
            return override, f"{MAX_RANKS_ENV}={override}"
        return (
            FAKE_MAX_RANKS,
            f"fake CP runs one thread per rank, at most {FAKE_MAX_RANKS}; "
            f"set {MAX_RANKS_ENV} to change the bound",
        )
    raise ValueError(f"backend must be 'fake', 'gloo' or 'nccl', got {backend!r}")


def check_cp_limit(cp_size: int, backend: str, *, who: str) -> int:
    """`cp_size` if `backend` can run that many ranks here, else a ValueError saying the bound."""
    limit, why = cp_limit(backend)
    if cp_size > limit:
        raise ValueError(
            f"{who}: cp_size {cp_size} is more than the {backend} backend can run here "
            f"(at most {limit}: {why})"
        )
    return cp_size
