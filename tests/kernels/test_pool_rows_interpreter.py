"""`kernels.pool_rows` on the CPU through Triton's interpreter, bit for bit its twins
`ops.pool_rows`: the window's SWA rows (page table and slot map, including the expanded map a
cache starts with; windows 1, 6 and 128; rows not a multiple of the block; req_to_token int32
and int64, a row slice of a wider table, slots of −1 inside a request's row) and the slot → row
map (any shape, empty)."""

from __future__ import annotations

import sys

import pytest

from tests.kernels.interpreter_child import report_cases, run_interpreter_cases

CASES = ("window_rows_twin", "swa_rows_twin", "bad_arguments")


@pytest.fixture(scope="module")
def child_results() -> dict[str, str]:
    return run_interpreter_cases(__file__, CASES)


@pytest.mark.parametrize("case", CASES)
def test_pool_rows_in_the_interpreter(case: str, child_results: dict[str, str]) -> None:
    assert child_results[case] == "ok", child_results[case]


# ------------------------------------------------------------------ the cases (child process only)


def _cases() -> dict[str, object]:
    import torch

    from dsv4cp.kernels import pool_rows as kern
    from dsv4cp.ops import pool_rows as ops

    g = torch.Generator().manual_seed(0)
    page, n_slots = 4, 400

    def tables(mode: str):
        table = torch.randint(-1, 90, (n_slots // page,), generator=g, dtype=torch.int32)
        if mode == "pages":
            return None, table
        if mode == "map":
            m = torch.randint(0, 300, (n_slots,), generator=g)
            m[::7] = 0  # slots not held
            return m, table
        return torch.zeros(1, dtype=torch.long).expand(n_slots), table

    def equal(a, b, what: str) -> None:
        assert a.dtype == b.dtype and a.shape == b.shape, (what, a.dtype, b.dtype, a.shape)
        assert torch.equal(a, b), f"{what}: {(a != b).sum().item()} differ"

    def window_rows_twin():
        t = 37
        for mode in ("pages", "map", "map-empty"):
            slot_map, table = tables(mode)
            for dtype in (torch.int32, torch.int64):
                wide = torch.randint(0, n_slots, (4, 300), generator=g).to(dtype)
                wide[2, 50:60] = -1  # slots of −1 inside a request's row
                r2t = wide[:, :260]  # a slice: row stride 300
                positions = torch.randint(0, 260, (t,), generator=g)
                positions[:4] = torch.tensor([0, 1, 5, 127])
                req_row = torch.randint(0, 4, (t,), generator=g)
                valid = torch.rand(t, generator=g) > 0.2
                for window in (1, 6, 128):
                    args = (positions, valid, req_row, r2t, window, slot_map, table, page)
                    want = ops.window_rows(*args)
                    equal(kern.window_rows(*args), want, f"{mode} {dtype} W={window}")
                    assert mode == "map-empty" or bool((want >= 0).any())

    def swa_rows_twin():
        for mode in ("pages", "map", "map-empty"):
            slot_map, table = tables(mode)
            for shape in ((0,), (1,), (2500,), (3, 70)):
                slots = torch.randint(-1, n_slots, shape, generator=g)
                want = ops.swa_rows(slots, slot_map, table, page)
                equal(kern.swa_rows(slots, slot_map, table, page), want, f"{mode} {shape}")

    def bad_arguments():
        slot_map, table = tables("pages")
        pos = torch.zeros(3, dtype=torch.long)
        ok = torch.ones(3, dtype=torch.bool)
        r2t = torch.zeros(2, 8, dtype=torch.long)
        for args, words in (
            ((pos, ok, pos, r2t, 0, None, table, page), "window must be"),
            ((pos, ok[:2], pos, r2t, 4, None, table, page), "alike"),
            ((pos, ok, pos, r2t.t(), 4, None, table, page), "unit stride"),
            ((pos, ok, pos, r2t, 4, None, table, 0), "page_size"),
        ):
            try:
                kern.window_rows(*args)
            except ValueError as e:
                assert words in str(e), (words, e)
            else:
                raise AssertionError(f"no ValueError for {words}")

    return {name: fn for name, fn in locals().items() if name in CASES}


if __name__ == "__main__":
    report_cases(_cases(), sys.argv[1:])
