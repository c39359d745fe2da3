"""Which collectives gloo runs (docs/ep.md, "The collective"): all_to_all_single with equal and
uneven split sizes, all_to_all (lists), reduce_scatter_tensor and reduce_scatter, on 2 spawned
gloo processes; CPU tensors by default, CUDA tensors with `cuda` (every rank on cuda:0).

    python benchmarks/gloo_collectives.py [cpu|cuda]
"""

from __future__ import annotations

import sys
import warnings
from collections.abc import Callable

import torch
import torch.distributed as dist

from dsv4cp.cp.dist import TorchDistCPGroup
from dsv4cp.cp.launch import spawn_ranks


def _try(fn: Callable[[], object]) -> str:
    try:
        return repr(fn())
    except Exception as e:  # noqa: BLE001 - the probe reports what the backend refuses
        return f"FAILED {type(e).__name__}: {str(e).strip()[:160]}"


def probe(group: TorchDistCPGroup, device: str) -> dict[str, str]:
    warnings.simplefilter("ignore", FutureWarning)
    g, r = group.group, group.rank
    x = torch.arange(6, dtype=torch.float32, device=device) + 10 * r

    def a2a_equal() -> list[float]:
        out = torch.empty(6, device=device)
        dist.all_to_all_single(out, x, group=g)
        return out.tolist()

    def a2a_uneven() -> list[float]:
        send = [1 + r, 5 - r]  # rank 0 sends 1 + 5, rank 1 sends 2 + 4
        recv = [1, 2] if r == 0 else [5, 4]
        out = torch.empty(sum(recv), device=device)
        dist.all_to_all_single(out, x, recv, send, group=g)
        return out.tolist()

    def a2a_list() -> list[list[float]]:
        outs = [torch.empty(3, device=device) for _ in range(2)]
        dist.all_to_all(outs, list(x.chunk(2)), group=g)
        return [t.tolist() for t in outs]

    def rs_tensor() -> list[float]:
        out = torch.empty(3, device=device)
        dist.reduce_scatter_tensor(out, x, group=g)
        return out.tolist()

    def rs_list() -> list[float]:
        out = torch.empty(3, device=device)
        dist.reduce_scatter(out, list(x.chunk(2)), group=g)
        return out.tolist()

    return {
        "all_to_all_single (equal)": _try(a2a_equal),
        "all_to_all_single (uneven)": _try(a2a_uneven),
        "all_to_all (lists)": _try(a2a_list),
        "reduce_scatter_tensor": _try(rs_tensor),
        "reduce_scatter (lists)": _try(rs_list),
    }


def main() -> None:
    device = sys.argv[1] if len(sys.argv) > 1 else "cpu"
    print(f"torch {torch.__version__}, gloo, 2 processes, {device} tensors")
    for rank, res in enumerate(spawn_ranks(2, probe, (device,), backend="gloo")):
        for name, value in res.items():
            print(f"  rank {rank} {name:<28} {value}")


if __name__ == "__main__":
    main()
