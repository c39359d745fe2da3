from __future__ import annotations

import threading
import time

import pytest
import torch
import torch.distributed as dist

from dsv4cp.cp import (
    CPGroup,
    CPLayout,
    CPOrderError,
    CPRankFailedError,
    CPTimeoutError,
    FakeCPGroup,
    FakeCPWorld,
    SingleCPGroup,
    TorchDistCPGroup,
    gather_global,
    gather_indexed,
    new_cp_group,
    run_cp,
    run_ranks,
    spawn_ranks,
)

DTYPES = (torch.float32, torch.bfloat16, torch.int64, torch.bool, torch.float8_e4m3fn)


def _rank_tensor(rank: int, rows: int, dtype: torch.dtype) -> torch.Tensor:
    base = torch.arange(rows * 3, dtype=torch.float32).view(rows, 3) + 100 * rank
    return (base % 2 == 0) if dtype == torch.bool else base.to(dtype)


def _bytes(x: torch.Tensor) -> torch.Tensor:
    return x.contiguous().view(torch.uint8)


# ---- fake world ------------------------------------------------------------------------------
def _gather_dtypes(group: CPGroup) -> list[torch.Tensor]:
    return [group.all_gather(_rank_tensor(group.rank, 2, dt), tag=f"t/{dt}") for dt in DTYPES]


@pytest.mark.parametrize("cp", (1, 2, 3, 4))
def test_fake_all_gather_is_rank_major_concat(cp: int) -> None:
    world = FakeCPWorld(cp, timeout_s=10)
    results = run_ranks(world, _gather_dtypes)
    for per_rank in results:
        for dt, got in zip(DTYPES, per_rank):
            want = torch.cat([_rank_tensor(r, 2, dt) for r in range(cp)])
            assert got.dtype == dt and got.shape == (2 * cp, 3)
            assert torch.equal(_bytes(got), _bytes(want))


def _round_trip(group: CPGroup, t: int, align: int) -> torch.Tensor:
    lay = CPLayout.build(t, group.cp_size, align=align)
    x = torch.arange(t * 2, dtype=torch.float32).view(t, 2)
    full = lay.unshard(group.all_gather(lay.shard(x, group.rank), tag="layer0/x"))
    part = gather_global(group, lay, x[group.rank :: group.cp_size], tag="layer0/logical")
    assert torch.equal(part, full)
    rows, idx = gather_indexed(group, lay, x[group.rank :: group.cp_size], tag="layer0/indexed")
    if group.cp_size == 1:
        assert idx is None and torch.equal(rows, full)
    else:  # the all-gather as it comes (padding rows too), token t at row idx[t]
        assert rows.shape[0] == lay.gathered_rows and torch.equal(rows[idx], full)
    return full


@pytest.mark.parametrize(("t", "cp", "align"), [(10, 4, 4), (1, 3, 1), (31, 2, 1), (130, 3, 4)])
def test_fake_layout_round_trip(t: int, cp: int, align: int) -> None:
    x = torch.arange(t * 2, dtype=torch.float32).view(t, 2)
    for got in run_ranks(FakeCPWorld(cp, timeout_s=10), _round_trip, t, align):
        assert torch.equal(got, x)


def test_fake_barrier_and_world_reuse() -> None:
    world = FakeCPWorld(3, timeout_s=10)

    def fn(group: FakeCPGroup) -> int:
        group.barrier()
        group.all_gather(torch.zeros(1), tag="a")
        group.barrier()
        return group.guard.seq

    assert run_ranks(world, fn) == [3, 3, 3]
    assert run_ranks(world, fn) == [3, 3, 3]  # reset between runs


def test_fake_many_collectives_stress() -> None:
    def fn(group: CPGroup) -> int:
        for i in range(300):
            x = torch.full((2,), float(group.rank * 1000 + i))
            out = group.all_gather(x, tag=f"layer{i}/x")
            want = torch.tensor([float(r * 1000 + i) for r in range(group.cp_size)])
            assert torch.equal(out, want.repeat_interleave(2)), (group.rank, i)
            if i % 50 == 0:
                group.barrier()
        return i

    assert run_ranks(FakeCPWorld(4, timeout_s=10), fn) == [299] * 4


def test_fake_non_contiguous_input() -> None:
    def fn(group: CPGroup) -> torch.Tensor:
        x = torch.arange(12.0).view(3, 4).t()[:, :2] + group.rank
        assert not x.is_contiguous()
        return group.all_gather(x, tag="nc")

    out = run_ranks(FakeCPWorld(2), fn)[0]
    base = torch.arange(12.0).view(3, 4).t()[:, :2]
    assert torch.equal(out, torch.cat([base, base + 1]))


def test_fake_rank_never_arrives_times_out() -> None:
    timeout = 0.3
    seen: dict[int, float] = {}

    def fn(group: CPGroup) -> None:
        if group.rank == 1:
            time.sleep(1.0)  # busy elsewhere: never issues the collective in time
            return
        t0 = time.monotonic()
        try:
            group.all_gather(torch.zeros(2), tag="layer5/kv_raw")
        finally:
            seen[group.rank] = time.monotonic() - t0

    with pytest.raises(CPTimeoutError, match=r"layer5/kv_raw.*timed out.*rank\(s\) \[1\]"):
        run_ranks(FakeCPWorld(2, timeout_s=timeout), fn)
    assert seen[0] < timeout + 1.0


def test_fake_rank_raises_others_fail_fast() -> None:
    errors: dict[int, BaseException] = {}

    def fn(group: CPGroup) -> None:
        if group.rank == 2:
            raise ValueError("boom on rank 2")
        try:
            group.all_gather(torch.zeros(2), tag="layer1/x")
        except BaseException as e:
            errors[group.rank] = e
            raise

    t0 = time.monotonic()
    with pytest.raises(ValueError, match="boom on rank 2") as info:
        run_ranks(FakeCPWorld(3, timeout_s=30), fn)
    assert time.monotonic() - t0 < 5.0  # far below the 30 s timeout
    assert info.value.cp_rank == 2
    for r in (0, 1):
        assert isinstance(errors[r], CPRankFailedError)
        assert "rank 2 failed" in str(errors[r]) and "layer1/x" in str(errors[r])


def test_fake_rank_returns_early() -> None:
    def fn(group: CPGroup) -> None:
        group.all_gather(torch.zeros(1), tag="common")
        if group.rank == 0:
            group.all_gather(torch.zeros(1), tag="layer9/extra")

    t0 = time.monotonic()
    with pytest.raises(CPRankFailedError, match=r"layer9/extra.*rank\(s\) \[1\]"):
        run_ranks(FakeCPWorld(2, timeout_s=30), fn)
    assert time.monotonic() - t0 < 5.0


def test_fake_shape_mismatch_always_raises() -> None:
    def fn(group: CPGroup) -> None:
        group.all_gather(torch.zeros(2 + group.rank, 4), tag="layer2/x")

    with pytest.raises(CPOrderError, match=r"(?s)shape.*\(2, 4\).*\(3, 4\)"):
        run_ranks(FakeCPWorld(2, check_order=False), fn)


def test_fake_join_timeout() -> None:
    stop = threading.Event()

    def fn(group: CPGroup) -> None:
        stop.wait(5.0)

    try:
        with pytest.raises(CPTimeoutError, match="still running"):
            run_ranks(FakeCPWorld(2), fn, join_timeout_s=0.2)
    finally:
        stop.set()


# ---- protocol, single group, helpers ---------------------------------------------------------
def test_protocol_and_single_group() -> None:
    world = FakeCPWorld(2)
    assert isinstance(SingleCPGroup(), CPGroup)
    assert isinstance(world.group(1), CPGroup)
    g = SingleCPGroup()
    x = torch.randn(3, 2)
    assert g.all_gather(x, tag="a") is x and g.cp_size == 1 and g.rank == 0
    g.barrier()
    lay = CPLayout.build(3, 1)
    assert torch.equal(gather_global(g, lay, x, tag="b"), x)
    assert run_cp(1, lambda grp: grp.cp_size) == [1]
    assert run_cp(3, _round_trip, 7, 1)[2].shape == (7, 2)


def test_input_errors() -> None:
    g = SingleCPGroup()
    with pytest.raises(ValueError, match="tag"):
        g.all_gather(torch.zeros(2), tag="")
    with pytest.raises(ValueError, match="0-d"):
        g.all_gather(torch.tensor(1.0), tag="x")
    with pytest.raises(TypeError, match="Tensor"):
        g.all_gather([1, 2], tag="x")  # type: ignore[arg-type]
    for bad in (0, -2, 1.5, True):
        with pytest.raises(ValueError, match="cp_size"):
            FakeCPWorld(bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="timeout_s"):
        FakeCPWorld(2, timeout_s=0)
    with pytest.raises(ValueError, match="P=2"):
        gather_global(g, CPLayout.build(3, 2), torch.zeros(3, 1), tag="x")
    with pytest.raises(ValueError, match="backend"):
        run_cp(2, _round_trip, backend="mpi")


def test_new_cp_group_without_world() -> None:
    assert not dist.is_initialized()
    assert isinstance(new_cp_group(1), SingleCPGroup)
    for bad in (0, -1):
        with pytest.raises(ValueError, match="cp_size"):
            new_cp_group(bad)
    with pytest.raises(ValueError, match="FakeCPWorld"):
        new_cp_group(2, backend="fake")
    with pytest.raises(ValueError, match="backend"):
        new_cp_group(2, backend="mpi")
    with pytest.raises(RuntimeError, match="not initialized"):
        new_cp_group(2)
    with pytest.raises(RuntimeError, match="not initialized"):
        TorchDistCPGroup()


def test_new_cp_groups_subgroups_get_the_timeout(monkeypatch: pytest.MonkeyPatch) -> None:
    """A subgroup's collectives wait `timeout_s`, not torch's default: gloo also waits with
    `work.wait(timeout)`, NCCL only has the group's own timeout."""
    from datetime import timedelta

    import dsv4cp.cp.dist as cp_dist

    made: list[tuple[str, dict]] = []

    def new_group(ranks: list[int], **kw: object) -> str:
        made.append(("new_group", kw))
        return "pg"

    def new_subgroups(size: int, **kw: object) -> tuple[str, list[str]]:
        made.append(("new_subgroups", kw))
        return "pg", ["pg"]

    for name, value in [
        ("is_initialized", lambda: True),
        ("get_world_size", lambda group=None: 4),
        ("get_rank", lambda group=None: 0),
        ("get_backend", lambda group=None: "gloo"),
        ("new_group", new_group),
        ("new_subgroups", new_subgroups),
    ]:
        monkeypatch.setattr(cp_dist.dist, name, value)
    monkeypatch.setattr(cp_dist, "TorchDistCPGroup", lambda group, **kw: (group, kw))
    assert new_cp_group(2, timeout_s=7.0) == ("pg", {"timeout_s": 7.0, "check_order": False})
    new_cp_group(2, ranks=[0, 1], timeout_s=7.0)
    new_cp_group(4, backend="nccl", timeout_s=7.0)
    assert [m[0] for m in made] == ["new_subgroups", "new_group", "new_subgroups"]
    assert all(kw["timeout"] == timedelta(seconds=7.0) for _, kw in made)


# ---- gloo (spawned processes) ----------------------------------------------------------------
def _gloo_worker(group: TorchDistCPGroup) -> dict:
    cp = group.cp_size
    out: dict = {
        "rank": group.rank,
        "cp": cp,
        "backend": group.backend,
        "check_shapes": group.check_shapes,
    }
    ok = []
    for got, dt in zip(_gather_dtypes(group), DTYPES):
        want = torch.cat([_rank_tensor(r, 2, dt) for r in range(cp)])
        ok.append(got.dtype == dt and torch.equal(_bytes(got), _bytes(want)))
    out["dtypes_ok"] = ok
    group.barrier()
    x_all = {}
    for t, align in ((1, 1), (5, 1), (10, 4), (31, 2)):
        x_all[t] = _round_trip(group, t, align)
    out["round_trip"] = x_all
    # new_cp_group inside a world of cp ranks
    errs = []
    for bad in (cp + 1, 0):
        try:
            new_cp_group(bad)
        except ValueError as e:
            errs.append(str(e))
    out["new_cp_group_errors"] = errs
    sub = new_cp_group(cp)
    out["sub"] = sub.all_gather(torch.full((1,), float(group.rank)), tag="sub").tolist()
    out["single"] = type(new_cp_group(1)).__name__
    return out


@pytest.mark.parametrize("cp", (2, 3))
def test_gloo_all_gather(cp: int) -> None:
    results = spawn_ranks(cp, _gloo_worker, timeout_s=30, check_order=True)
    assert [r["rank"] for r in results] == list(range(cp))
    for r in results:
        assert r["cp"] == cp and r["backend"] == "gloo" and r["check_shapes"]
        assert all(r["dtypes_ok"]), r["dtypes_ok"]
        for t, got in r["round_trip"].items():
            assert torch.equal(got, torch.arange(t * 2, dtype=torch.float32).view(t, 2))
        assert "larger than the distributed world" in r["new_cp_group_errors"][0]
        assert "cp_size" in r["new_cp_group_errors"][1]
        assert r["sub"] == [float(i) for i in range(cp)]
        assert r["single"] == "SingleCPGroup"


# ---- GPU (not run on CPU machines) -----------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_fake_cuda_side_streams() -> None:
    def fn(group: CPGroup) -> torch.Tensor:
        s = torch.cuda.Stream()
        with torch.cuda.stream(s):
            a = torch.randn(4096, 256, device="cuda")
            for _ in range(20):
                a = a @ torch.eye(256, device="cuda")  # keep the producer stream busy
            x = torch.full((8, 4), float(group.rank), device="cuda") + 0 * a[:8, :4]
            out = group.all_gather(x, tag="gpu/x")
        torch.cuda.current_stream().wait_stream(s)
        return out.cpu()

    for got in run_ranks(FakeCPWorld(2, timeout_s=30), fn):
        want = torch.cat([torch.zeros(8, 4), torch.ones(8, 4)])
        assert torch.equal(got, want)


def _nccl_worker(group: TorchDistCPGroup) -> torch.Tensor:
    x = torch.full((4, 8), float(group.rank), device="cuda", dtype=torch.bfloat16)
    out = group.all_gather(x, tag="nccl/x")
    group.barrier()
    return out


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_nccl_all_gather() -> None:
    results = spawn_ranks(2, _nccl_worker, backend="nccl", timeout_s=60, check_order=True)
    want = torch.cat([torch.zeros(4, 8), torch.ones(4, 8)]).to(torch.bfloat16)
    for got in results:
        assert torch.equal(got, want)
