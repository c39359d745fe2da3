"""Finiteness checks that name what is wrong: the tensor, the first bad element and its value.

`check_finite` reads the tensor on the host (a device sync): call it at load time, or per
forward only when debugging (`FINITE_CHECK_ENV`, read by `finite_check_requested`).
"""

from __future__ import annotations

import torch
from torch import Tensor

from dsv4cp import env_vars

__all__ = ["FINITE_CHECK_ENV", "check_finite", "finite_check_requested", "first_non_finite"]

FINITE_CHECK_ENV = "DSV4CP_CHECK_FINITE"


def finite_check_requested() -> bool:
    """True when DSV4CP_CHECK_FINITE=1: check every layer's output of every forward."""
    return bool(env_vars.read(FINITE_CHECK_ENV))


def first_non_finite(t: Tensor) -> tuple[tuple[int, ...], float, int] | None:
    """(index, value, count) of the first NaN or ±inf element of `t` in row-major order, and
    how many there are; None when every element is finite (or `t` is not floating point)."""
    if not t.is_floating_point():
        return None
    # torch's isfinite lacks (or, for e8m0, misreads) the 1-byte float formats: widen them.
    x = t.float() if t.element_size() == 1 else t
    bad = ~torch.isfinite(x)
    count = int(bad.sum())
    if count == 0:
        return None
    flat = int(bad.flatten().nonzero()[0, 0])
    index = tuple(int(i) for i in torch.unravel_index(torch.tensor(flat), tuple(t.shape)))
    return index, float(x.flatten()[flat]), count


def check_finite(t: Tensor, what: str, *, row_ids: Tensor | None = None) -> None:
    """Raise ValueError naming `what`, the first non-finite element and its value.

    `row_ids[i]`, when given, is what row i of `t` is called elsewhere (e.g. the global token
    of a CP rank's local row; negative = a padding row) and is named in the message."""
    found = first_non_finite(t)
    if found is None:
        return
    index, value, count = found
    where = f"index {list(index)}"
    if row_ids is not None and index:
        rid = int(row_ids[index[0]])
        where += f" (row {index[0]} = {'padding' if rid < 0 else f'global token {rid}'})"
    raise ValueError(
        f"{what}: non-finite value {value} at {where}; {count} of {t.numel()} elements are "
        "NaN or inf"
    )
