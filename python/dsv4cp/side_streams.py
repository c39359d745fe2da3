"""Side CUDA streams that no other live owner in this process holds.

`torch.cuda.Stream()` hands out streams from a per-device pool (32 per priority), round robin,
shared by every thread. Fake CP ranks are threads of one process that capture CUDA graphs at the
same time: at CP 8 with multistream and graphs, 8 × (4 lanes + 1 capture stream) = 40 > 32, so
two ranks were given the same stream and one rank's fork joined another rank's capture
("operation would result in a merge of separate capture sequences", or "Cannot register the
state during capturing stage" and an abort). Every side stream of dsv4cp (the multistream lanes,
`executors.StreamPool`, and the graph capture streams, `graphs/`) comes from `side_stream`:

- "runtime" / "driver": a new non-blocking stream made with `cudaStreamCreateWithFlags` of the
  CUDA runtime torch loaded, or else `cuStreamCreate` of the driver, wrapped in
  `torch.cuda.ExternalStream`. These streams are never destroyed (torch may still record events
  on them); once their owner is garbage-collected they are free for the next caller. Any number
  of owners can hold one.
- "pool" (when neither library is usable, or `DSV4CP_SIDE_STREAMS=pool`): torch's pool, skipping
  streams a live owner holds; when every pool stream is held, `SideStreamError` says so (e.g.
  fake CP 8 with multistream and graphs), before anything is captured.

`DSV4CP_SIDE_STREAMS`: auto (default: runtime, then driver, then pool), external (runtime or
driver, else an error), pool.

A stream is held until the `owner` named when it was handed out (a `StreamPool`, a
`GraphRunner`, a `BreakableGraph`) is garbage-collected, not until the stream object is: torch's
stream objects never run weakref callbacks (measured, torch 2.11 on the H200: a
`weakref.finalize` on a `torch.cuda.Stream` stays alive after the object is gone), so a
registry keyed on them never freed a stream (fake CP 4 with multistream and graphs then ran out
of torch's pool). Invariant: an owner does not pass its stream to anything that outlives it.
"""

from __future__ import annotations

import ctypes
import gc
import os
import threading
import weakref
from collections.abc import Callable
from typing import Any

import torch

from dsv4cp import env_vars

__all__ = [
    "MODE_ENV",
    "SideStreamError",
    "SideStreamRegistry",
    "check_side_streams",
    "side_stream",
    "side_stream_mode",
]

MODE_ENV = "DSV4CP_SIDE_STREAMS"
_NON_BLOCKING = 1  # cudaStreamNonBlocking == CU_STREAM_NON_BLOCKING


class SideStreamError(ValueError):
    """No side stream can be handed out without sharing one with another live owner."""


Creator = Callable[[int], int]  # device index → a new raw stream handle


class SideStreamRegistry:
    """Hands out side streams, each held by one owner at a time (the `owner` given to `acquire`).

    `create(device)`: a new raw stream handle (None: only `draw` is available); `draw(device)`:
    the next stream of torch's pool; `wrap(handle, device)`: a stream object for a raw handle;
    `spare`: raw handles already made and free (device → handles). Thread-safe: fake CP ranks
    ask from their own threads."""

    def __init__(
        self,
        create: Creator | None,
        draw: Callable[[int], Any],
        wrap: Callable[[int, int], Any],
        *,
        mode: str,
        spare: dict[int, list[int]] | None = None,
    ) -> None:
        self.create, self.draw, self.wrap, self.mode = create, draw, wrap, mode
        # Reentrant: a garbage collection inside `acquire` may run `_release` on this thread.
        self._lock = threading.RLock()
        self._held: dict[int, set[int]] = {}
        self._free: dict[int, list[int]] = {d: list(h) for d, h in (spare or {}).items()}

    def acquire(self, device: int, owner: object) -> Any:
        """A stream on `device` no live owner holds; it is `owner`'s until `owner` is collected."""
        with self._lock:
            held = self._held.setdefault(device, set())
            if self.create is not None:
                free = self._free.setdefault(device, [])
                handle = free.pop() if free else self.create(device)
                stream = self.wrap(handle, device)
            else:
                stream = self._draw_unheld(device, held)
                handle = int(stream.cuda_stream)
            held.add(handle)
            weakref.finalize(owner, self._release, device, handle)
            return stream

    def capacity(self, device: int) -> int | None:
        """How many side streams can be held at once on `device` (None: no bound)."""
        if self.create is not None:
            return None
        with self._lock:
            seen: set[int] = set()
            while (handle := int(self.draw(device).cuda_stream)) not in seen:
                seen.add(handle)
            return len(seen)

    def reserve_check(self, device: int, count: int, what: str) -> None:
        """SideStreamError, before anything is held, when `count` more streams cannot be had."""
        cap = self.capacity(device)
        if cap is not None and count + self.held(device) > cap:
            raise SideStreamError(
                f"side streams: {what} needs {count} side streams on cuda:{device} and torch's "
                f"pool has {cap} ({self.held(device)} held); use fewer fake CP ranks with "
                f"multistream and graphs, or leave {MODE_ENV} unset so that dedicated streams "
                "are made"
            )

    def held(self, device: int) -> int:
        with self._lock:
            return len(self._held.get(device, ()))

    def _draw_unheld(self, device: int, held: set[int]) -> Any:
        seen: set[int] = set()
        collected = False
        while True:
            stream = self.draw(device)
            handle = int(stream.cuda_stream)
            if handle not in held:
                return stream
            if handle in seen and not collected:  # owners that are gone but not yet collected
                gc.collect()
                collected, seen = True, set()
            elif handle in seen:  # a full turn of the pool: every stream is held
                raise SideStreamError(
                    f"side streams: all {len(seen)} streams of torch's pool on cuda:{device} are "
                    "held by live runners or graphs (each fake CP rank holds one per multistream "
                    "lane and one to capture graphs); use fewer fake CP ranks with multistream "
                    f"and graphs, or leave {MODE_ENV} unset so that dedicated streams are made"
                )
            seen.add(handle)

    def _release(self, device: int, handle: int) -> None:
        with self._lock:
            self._held.get(device, set()).discard(handle)
            if self.create is not None:
                self._free.setdefault(device, []).append(handle)


def _check(code: int, call: str) -> None:
    if code != 0:
        raise OSError(f"{call} failed with CUDA error {code}")


def _runtime_creator() -> Creator | None:
    """cudaStreamCreateWithFlags of the libcudart this process has loaded (torch's)."""
    try:
        with open("/proc/self/maps") as f:
            paths = {line.split()[-1] for line in f if "libcudart" in line}
    except OSError:
        return None
    for path in sorted(p for p in paths if os.path.basename(p).startswith("libcudart")):
        try:
            fn = ctypes.CDLL(path).cudaStreamCreateWithFlags
        except (OSError, AttributeError):
            continue
        fn.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_uint]
        fn.restype = ctypes.c_int

        def create(device: int, fn: Any = fn) -> int:
            handle = ctypes.c_void_p()
            with torch.cuda.device(device):
                _check(fn(ctypes.byref(handle), _NON_BLOCKING), "cudaStreamCreateWithFlags")
            return int(handle.value or 0)

        return create
    return None


def _driver_creator() -> Creator | None:
    """cuStreamCreate of the driver, in the device's primary context (the one torch uses)."""
    try:
        lib = ctypes.CDLL("libcuda.so.1")
        _check(lib.cuInit(0), "cuInit")
    except (OSError, AttributeError):
        return None
    primary: dict[int, ctypes.c_void_p] = {}

    def create(device: int) -> int:
        if device not in primary:
            dev, ctx = ctypes.c_int(), ctypes.c_void_p()
            _check(lib.cuDeviceGet(ctypes.byref(dev), device), "cuDeviceGet")
            _check(lib.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev), "cuDevicePrimaryCtxRetain")
            primary[device] = ctx
        _check(lib.cuCtxPushCurrent_v2(primary[device]), "cuCtxPushCurrent")
        try:
            handle = ctypes.c_void_p()
            _check(lib.cuStreamCreate(ctypes.byref(handle), _NON_BLOCKING), "cuStreamCreate")
        finally:
            _check(lib.cuCtxPopCurrent_v2(ctypes.byref(ctypes.c_void_p())), "cuCtxPopCurrent")
        return int(handle.value or 0)

    return create


def _first_stream(make: Callable[[], Creator | None]) -> tuple[Creator, int] | None:
    """`make()`'s creator and a first stream it made on the current device, if it works."""
    try:
        create = make()
        handle = create(torch.cuda.current_device()) if create is not None else 0
    except (OSError, RuntimeError):
        return None
    return (create, handle) if create is not None and handle else None


def _wrap(handle: int, device: int) -> torch.cuda.Stream:
    return torch.cuda.ExternalStream(handle, device=device)


def _draw(device: int) -> torch.cuda.Stream:
    return torch.cuda.Stream(device=device)


_registry: SideStreamRegistry | None = None
_registry_lock = threading.Lock()


def _build_registry() -> SideStreamRegistry:
    wanted = env_vars.read(MODE_ENV)
    if wanted != "pool":
        for mode, make in (("runtime", _runtime_creator), ("driver", _driver_creator)):
            first = _first_stream(make)
            if first is not None:
                spare = {torch.cuda.current_device(): [first[1]]}
                return SideStreamRegistry(first[0], _draw, _wrap, mode=mode, spare=spare)
        if wanted == "external":
            raise SideStreamError(
                f"{MODE_ENV}=external: neither the CUDA runtime nor the driver could create a "
                "stream in this process"
            )
    return SideStreamRegistry(None, _draw, _wrap, mode="pool")


def _get_registry() -> SideStreamRegistry:
    global _registry
    with _registry_lock:
        if _registry is None:
            _registry = _build_registry()
        return _registry


def side_stream(device: torch.device | int | None = None, *, owner: object) -> torch.cuda.Stream:
    """A CUDA stream on `device` (default: the current one) that no other live owner holds;
    it is `owner`'s until `owner` is garbage-collected."""
    if isinstance(device, torch.device):
        index = device.index if device.index is not None else torch.cuda.current_device()
    else:
        index = torch.cuda.current_device() if device is None else int(device)
    stream: torch.cuda.Stream = _get_registry().acquire(index, owner)
    return stream


def check_side_streams(count: int, what: str, device: int | None = None) -> None:
    """Refuse up front (`SideStreamError`) when `count` side streams cannot be held at once."""
    index = torch.cuda.current_device() if device is None else device
    _get_registry().reserve_check(index, count, what)


def side_stream_mode() -> str:
    """How side streams are made in this process: "runtime", "driver" or "pool"."""
    return _get_registry().mode
