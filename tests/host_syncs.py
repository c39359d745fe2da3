"""A dispatch mode that records the aten ops reading a tensor's values on the host: a sync on
CUDA, and an error inside a CUDA graph capture (the torch route of `ops` may run in one)."""

from __future__ import annotations

import traceback
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

SYNCING = (
    "aten.nonzero",
    "aten.item",
    "aten._local_scalar_dense",
    "aten.is_nonzero",
    "aten.equal",
    "aten.allclose",
    "aten.masked_select",
    "aten.unique",
    "aten._unique2",
)


class HostSyncs(TorchDispatchMode):
    """`ops`: (op, the innermost dsv4cp frame as "file:line function") per host-reading op:
    nonzero, item, equal, masked_select, unique, boolean-mask indexing, repeat_interleave by
    counts without output_size."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[tuple[str, str]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        name = str(func.overloadpacket)
        index: Any = args[1] if name == "aten.index" and len(args) > 1 else ()
        # repeat_interleave by a tensor of counts sizes its output from their sum (no output_size)
        counted = (
            name == "aten.repeat_interleave"
            and isinstance(args[0] if len(args) == 1 else args[1], torch.Tensor)
            and (kwargs or {}).get("output_size") is None
        )
        if (
            name in SYNCING
            or counted
            or any(t is not None and t.dtype == torch.bool for t in index)
        ):
            frames = [f for f in traceback.extract_stack() if "dsv4cp" in f.filename] or [None]
            last = frames[-1]
            where = (
                f"{last.filename.split('python/')[-1]}:{last.lineno} {last.name}" if last else "?"
            )
            self.ops.append((name, where))
        return func(*args, **(kwargs or {}))
