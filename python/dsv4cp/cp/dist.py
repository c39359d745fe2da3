"""`TorchDistCPGroup`: a torch.distributed process group as a `CPGroup` (NCCL on GPU, gloo on
CPU), and `new_cp_group`, which carves this process's CP group out of an initialized world."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import cast

import torch
import torch.distributed as dist
from torch import Tensor

from dsv4cp.cp.group import (
    CPCommError,
    CPGroup,
    CPTimeoutError,
    SingleCPGroup,
    check_cp_size,
    check_input,
    check_splits,
    check_timeout,
)
from dsv4cp.cp.guard import CollectiveRecord, OrderGuard, resolve_check_order, splits_crc

__all__ = ["TorchDistCPGroup", "new_cp_group"]

_RAW_BYTE_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)  # collectives lack fp8: send bytes


class TorchDistCPGroup:
    """A torch.distributed process group as a CPGroup.

    NCCL: `all_gather_single` (all_gather_into_tensor) with async_op=False, which torch ≥ 2.8
    launches on the current stream. gloo: the same call, async, waited with `timeout_s`.
    `all_to_all`: `all_to_all_single` with the split sizes of the matrix, the same way (gloo
    runs it on CPU and CUDA tensors; gloo's list `all_to_all` refuses CUDA tensors: docs/ep.md).

    Records: with `check_order` (or DSV4CP_DEBUG_CP=1) every collective is preceded by an
    all-gather of a fixed-size int64 record (seq, tag crc, shape, dtype) and ranks that
    disagree raise `CPOrderError` on every rank. `check_shapes` (default: on for gloo, off for
    NCCL, where the extra round trip costs a host sync) does the same exchange but compares only
    shape and dtype, so a shape mismatch raises instead of hanging or corrupting memory. Without
    either, mismatched shapes are undefined behaviour (NCCL) and only the group timeout protects.
    Records are skipped while a CUDA graph is being captured (they need a host read).
    """

    def __init__(
        self,
        group: dist.ProcessGroup | None = None,
        *,
        timeout_s: float = 60.0,
        check_order: bool | None = False,
        check_shapes: bool | None = None,
    ) -> None:
        if not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError(
                "TorchDistCPGroup: torch.distributed is not initialized; call "
                "init_process_group first (or use dsv4cp.cp.launch.spawn_ranks)"
            )
        self._group = group
        rank = dist.get_rank(group)
        if rank < 0:
            raise ValueError("TorchDistCPGroup: this process is not a member of the group")
        self._rank = rank
        self._cp_size = dist.get_world_size(group)
        self.backend = str(dist.get_backend(group)).lower()
        self.capturable = self.backend == "nccl"  # NCCL collectives can live in a CUDA graph
        self.timeout_s = check_timeout(timeout_s)
        self.check_order = resolve_check_order(check_order)
        shapes = (self.backend != "nccl") if check_shapes is None else bool(check_shapes)
        self.check_shapes = self.check_order or shapes
        self.guard = OrderGuard(self._rank, self._cp_size)
        self._gather_into = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor

    @property
    def cp_size(self) -> int:
        return self._cp_size

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def group(self) -> dist.ProcessGroup | None:
        return self._group

    def __repr__(self) -> str:
        return (
            f"TorchDistCPGroup(rank={self._rank}, cp_size={self._cp_size}, "
            f"backend={self.backend!r}, check_order={self.check_order})"
        )

    def all_gather(self, x: Tensor, *, tag: str) -> Tensor:
        x = check_input(x, tag)
        rec = self.guard.next("all_gather", tag, x)
        if self._cp_size == 1:
            return x
        self._exchange(rec)
        wire = x.view(torch.uint8) if x.dtype in _RAW_BYTE_DTYPES else x
        out = wire.new_empty((self._cp_size * wire.shape[0], *wire.shape[1:]))
        self._run(rec, lambda: self._gather_raw(out, wire))
        return out.view(x.dtype) if wire is not x else out

    def all_to_all(self, x: Tensor, splits: Sequence[Sequence[int]], *, tag: str) -> Tensor:
        x = check_input(x, tag)
        matrix, send, recv = check_splits(x, splits, self._rank, self._cp_size, tag)
        total = sum(map(sum, matrix))
        rec = self.guard.next(
            "all_to_all", tag, x, shape=(total, *x.shape[1:]), splits=splits_crc(matrix)
        )
        if self._cp_size == 1:
            return x
        self._exchange(rec)
        wire = x.view(torch.uint8) if x.dtype in _RAW_BYTE_DTYPES else x
        out = wire.new_empty((sum(recv), *wire.shape[1:]))
        self._run(rec, lambda: self._all_to_all_raw(out, wire, send, recv))
        return out.view(x.dtype) if wire is not x else out

    def barrier(self) -> None:
        rec = self.guard.next("barrier", "barrier", None)
        if self._cp_size == 1:
            return
        self._exchange(rec)

        def op() -> None:
            if self.backend == "gloo":
                dist.monitored_barrier(self._group, timeout=self._td(), wait_all_ranks=True)
            elif self.backend == "nccl":
                dist.barrier(self._group, device_ids=[torch.cuda.current_device()])
            else:
                dist.barrier(self._group)

        self._run(rec, op)

    # --- internals ---------------------------------------------------------------------------
    def _td(self) -> timedelta:
        return timedelta(seconds=self.timeout_s)

    def _gather_raw(self, out: Tensor, x: Tensor) -> None:
        if self.backend == "nccl":
            self._gather_into(out, x, group=self._group)  # current stream, ordered on it
            return
        work = self._gather_into(out, x, group=self._group, async_op=True)
        if work is not None:  # async_op=True always returns a Work handle
            work.wait(timeout=self._td())

    def _all_to_all_raw(self, out: Tensor, x: Tensor, send: list[int], recv: list[int]) -> None:
        if self.backend == "nccl":  # current stream, ordered on it
            dist.all_to_all_single(out, x, recv, send, group=self._group)
            return
        work = dist.all_to_all_single(out, x, recv, send, group=self._group, async_op=True)
        if work is not None:
            work.wait(timeout=self._td())

    def _run(self, rec: CollectiveRecord, op: Callable[[], None]) -> None:
        try:
            op()
        except Exception as e:
            text = str(e)
            cls = CPTimeoutError if "timed out" in text.lower() else CPCommError
            raise cls(
                f"CP rank {self._rank}/{self._cp_size} ({self.backend}): #{rec.seq} "
                f"{rec.describe()} failed: {type(e).__name__}: {text.strip()[:2000]}"
            ) from e

    def _exchange(self, rec: CollectiveRecord) -> None:
        if not self.check_shapes:
            return
        if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
            return
        dev = (
            torch.device("cuda", torch.cuda.current_device())
            if self.backend == "nccl"
            else torch.device("cpu")
        )
        mine = torch.tensor(rec.encode(), dtype=torch.int64, device=dev)
        out = mine.new_empty((self._cp_size * mine.numel(),))
        self._run(rec, lambda: self._gather_raw(out, mine))
        rows = out.view(self._cp_size, -1).cpu().tolist()
        records = [CollectiveRecord.decode(row) for row in rows]
        records[self._rank] = rec
        self.guard.verify(records, check_tags=self.check_order)


def new_cp_group(
    cp_size: int,
    backend: str = "auto",
    *,
    ranks: Sequence[int] | None = None,
    timeout_s: float = 60.0,
    check_order: bool | None = False,
) -> CPGroup:
    """This process's CP group inside an initialized torch.distributed world.

    cp_size 1 → `SingleCPGroup`. Otherwise the world is split into consecutive blocks of
    cp_size ranks (or `ranks` is used as this group, all processes must pass the same list),
    and the block holding this rank is wrapped in a `TorchDistCPGroup`. backend "auto" uses the
    world's backend; "gloo"/"nccl" create the group with that backend. For "fake" (threads in
    one process) use `FakeCPWorld` + `run_ranks`, or `dsv4cp.cp.launch.run_cp`.
    """
    check_cp_size(cp_size, who="new_cp_group")
    if backend not in ("auto", "gloo", "nccl", "fake"):
        raise ValueError(f"backend must be 'auto', 'gloo', 'nccl' or 'fake', got {backend!r}")
    if backend == "fake":
        raise ValueError(
            "a fake CP world lives in one process: use FakeCPWorld(cp_size) and "
            "run_ranks(world, fn), or dsv4cp.cp.launch.run_cp(..., backend='fake')"
        )
    if cp_size == 1 and ranks is None:
        return SingleCPGroup()
    if not dist.is_initialized():
        raise RuntimeError(
            f"new_cp_group(cp_size={cp_size}): torch.distributed is not "
            "initialized (call init_process_group, or use spawn_ranks)"
        )
    world = dist.get_world_size()
    if cp_size > world:
        raise ValueError(f"cp_size {cp_size} is larger than the distributed world ({world} ranks)")
    pg_backend = None if backend == "auto" else backend
    if ranks is not None:
        ranks = [int(r) for r in ranks]
        if len(ranks) != cp_size or len(set(ranks)) != cp_size:
            raise ValueError(f"ranks {ranks} must be {cp_size} distinct ranks")
        if any(not 0 <= r < world for r in ranks):
            raise ValueError(f"ranks {ranks} out of range for a world of {world}")
        group = dist.new_group(ranks, backend=pg_backend, timeout=timedelta(seconds=timeout_s))
        if dist.get_rank() not in ranks:
            raise ValueError(f"this process (rank {dist.get_rank()}) is not in ranks {ranks}")
    elif cp_size == world and pg_backend in (None, dist.get_backend()):
        group = None
    else:
        if world % cp_size:
            raise ValueError(f"world size {world} is not a multiple of cp_size {cp_size}")
        group, _ = dist.new_subgroups(
            cp_size, backend=pg_backend, timeout=timedelta(seconds=timeout_s)
        )
    # Members get a ProcessGroup (the non-members raised above).
    return TorchDistCPGroup(
        cast("dist.ProcessGroup | None", group), timeout_s=timeout_s, check_order=check_order
    )
