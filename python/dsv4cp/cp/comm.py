"""CP collectives: the `CPGroup` protocol and its backends.

`all_gather(x [P, ...], tag=...)` returns [cp·P, ...] rank-major and is issued on the CURRENT
stream (never pick a side stream here: DESIGN.md invariant 1). Every rank must pass the same
shape; the caller pads with `CPLayout.shard`. `tag` names the tensor ("layer3/kv_raw") for the
order guard and for error messages.

Backends:
- `TorchDistCPGroup`: a torch.distributed group (NCCL on GPU, gloo on CPU).
- `FakeCPWorld` / `FakeCPGroup` (`cp/fake.py`): every rank simulated by a thread of one process.
- `SingleCPGroup`: cp_size 1.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any, Protocol, runtime_checkable

import torch
import torch.distributed as dist
from torch import Tensor

from dsv4cp.cp.guard import CollectiveRecord, OrderGuard, resolve_check_order

__all__ = [
    "CPCommError",
    "CPGroup",
    "CPRankFailedError",
    "CPTimeoutError",
    "FakeCPGroup",
    "FakeCPWorld",
    "SingleCPGroup",
    "TorchDistCPGroup",
    "gather_global",
    "new_cp_group",
    "run_ranks",
]


class CPCommError(RuntimeError):
    """A CP collective failed: bad input, a dead or failed peer, a backend error."""


class CPTimeoutError(CPCommError, TimeoutError):
    """A CP collective did not complete within the group's timeout."""


class CPRankFailedError(CPCommError):
    """A collective was abandoned because another rank failed or finished early (fake world)."""


@runtime_checkable
class CPGroup(Protocol):
    """What the model sees of context parallelism.

    Backends may set `capturable = True` when their all_gather can be captured into a CUDA
    graph (NCCL, or no collective at all); others become eager breaks under graphs.
    """

    @property
    def cp_size(self) -> int: ...

    @property
    def rank(self) -> int: ...

    def all_gather(self, x: Tensor, *, tag: str) -> Tensor:
        """x [P, ...] (same shape on every rank) → [cp·P, ...] rank-major, current stream."""
        ...

    def barrier(self) -> None: ...


def _check_input(x: Tensor, tag: str) -> Tensor:
    if not isinstance(tag, str) or not tag:
        raise ValueError(
            f"all_gather needs a non-empty str tag (e.g. 'layer3/kv_raw'), got {tag!r}"
        )
    if not isinstance(x, Tensor):
        raise TypeError(f"all_gather {tag!r}: expected a Tensor, got {type(x).__name__}")
    if x.dim() == 0:
        raise ValueError(f"all_gather {tag!r}: x must have a row dim, got a 0-d tensor")
    return x.contiguous()


def _check_timeout(timeout_s: float) -> float:
    t = float(timeout_s)
    if not t > 0:
        raise ValueError(f"timeout_s must be > 0, got {timeout_s!r}")
    return t


def gather_global(group: CPGroup, layout: Any, x: Tensor, *, tag: str) -> Tensor:
    """The gather + rerange primitive: local rows x [P, ...] (or [logical, ...]: padded here)
    → global rows [T, ...] in token order. `layout` is a `CPLayout`."""
    p = layout.padded_rows
    if x.dim() == 0 or x.shape[0] > p:
        raise ValueError(f"gather_global {tag!r}: expected at most P={p} rows, got "
                         f"{tuple(x.shape)}")
    if x.shape[0] < p:
        pad = x.new_zeros((p - x.shape[0], *x.shape[1:]))
        x = torch.cat([x, pad])
    if group.cp_size == 1:
        return x[: layout.num_tokens]
    return layout.unshard(group.all_gather(x, tag=tag))


# --------------------------------------------------------------------------------------------
class SingleCPGroup:
    """cp_size 1: all_gather returns its input (no copy)."""

    cp_size = 1
    rank = 0
    capturable = True  # no collective at all

    def all_gather(self, x: Tensor, *, tag: str) -> Tensor:
        return _check_input(x, tag)

    def barrier(self) -> None:
        return None

    def __repr__(self) -> str:
        return "SingleCPGroup()"


# --------------------------------------------------------------------------------------------
_RAW_BYTE_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)  # collectives lack fp8: send bytes


class TorchDistCPGroup:
    """A torch.distributed process group as a CPGroup.

    NCCL: `all_gather_single` (all_gather_into_tensor) with async_op=False, which torch ≥ 2.8
    launches on the current stream. gloo: the same call, async, waited with `timeout_s`.

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
        self.timeout_s = _check_timeout(timeout_s)
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
        return (f"TorchDistCPGroup(rank={self._rank}, cp_size={self._cp_size}, "
                f"backend={self.backend!r}, check_order={self.check_order})")

    def all_gather(self, x: Tensor, *, tag: str) -> Tensor:
        x = _check_input(x, tag)
        rec = self.guard.next("all_gather", tag, x)
        if self._cp_size == 1:
            return x
        self._exchange(rec)
        wire = x.view(torch.uint8) if x.dtype in _RAW_BYTE_DTYPES else x
        out = wire.new_empty((self._cp_size * wire.shape[0], *wire.shape[1:]))
        self._run(rec, lambda: self._gather_raw(out, wire))
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
        dev = (torch.device("cuda", torch.cuda.current_device())
               if self.backend == "nccl" else torch.device("cpu"))
        mine = torch.tensor(rec.encode(), dtype=torch.int64, device=dev)
        out = mine.new_empty((self._cp_size * mine.numel(),))
        self._run(rec, lambda: self._gather_raw(out, mine))
        rows = out.view(self._cp_size, -1).cpu().tolist()
        records = [CollectiveRecord.decode(row) for row in rows]
        records[self._rank] = rec
        self.guard.verify(records, check_tags=self.check_order)


# --------------------------------------------------------------------------------------------
# --------------------------------------------------------------------------------------------
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
    if isinstance(cp_size, bool) or not isinstance(cp_size, int) or cp_size < 1:
        raise ValueError(f"cp_size must be a positive int, got {cp_size!r}")
    if backend not in ("auto", "gloo", "nccl", "fake"):
        raise ValueError(f"backend must be 'auto', 'gloo', 'nccl' or 'fake', got {backend!r}")
    if backend == "fake":
        raise ValueError("a fake CP world lives in one process: use FakeCPWorld(cp_size) and "
                         "run_ranks(world, fn), or dsv4cp.cp.launch.run_cp(..., backend='fake')")
    if cp_size == 1 and ranks is None:
        return SingleCPGroup()
    if not dist.is_initialized():
        raise RuntimeError(f"new_cp_group(cp_size={cp_size}): torch.distributed is not "
                           "initialized (call init_process_group, or use spawn_ranks)")
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
        group = dist.new_group(ranks, backend=pg_backend)
        if dist.get_rank() not in ranks:
            raise ValueError(f"this process (rank {dist.get_rank()}) is not in ranks {ranks}")
    elif cp_size == world and pg_backend in (None, dist.get_backend()):
        group = None
    else:
        if world % cp_size:
            raise ValueError(f"world size {world} is not a multiple of cp_size {cp_size}")
        group, _ = dist.new_subgroups(cp_size, backend=pg_backend)
    return TorchDistCPGroup(group, timeout_s=timeout_s, check_order=check_order)


# FakeCPGroup lives in its own file; re-exported here (after the names it needs exist).
from dsv4cp.cp.fake import FakeCPGroup, FakeCPWorld, run_ranks  # noqa: E402
