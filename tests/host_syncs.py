"""A dispatch mode that records the aten ops reading a tensor's values on the host: a sync on
CUDA, and an error inside a CUDA graph capture (the torch route of `ops` may run in one)."""

from __future__ import annotations

import traceback
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

SYNCING = ("aten.nonzero", "aten._local_scalar_dense", "aten.masked_select")


class HostSyncs(TorchDispatchMode):
    """`ops`: (op, the innermost dsv4cp frame) per host-reading op: nonzero, item, masked_select
    and boolean-mask indexing."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[tuple[str, str]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        name = str(func.overloadpacket)
        index: Any = args[1] if name == "aten.index" and len(args) > 1 else ()
        if name in SYNCING or any(t is not None and t.dtype == torch.bool for t in index):
            frames = [f for f in traceback.extract_stack() if "dsv4cp" in f.filename] or [None]
            last = frames[-1]
            where = f"{last.filename.split('python/')[-1]}:{last.lineno}" if last else "?"
            self.ops.append((name, where))
        return func(*args, **(kwargs or {}))
