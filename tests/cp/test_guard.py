from __future__ import annotations

import logging
import os
import pickle

import pytest
import torch

from dsv4cp.cp import (
    CPGroup,
    CPOrderError,
    FakeCPWorld,
    TorchDistCPGroup,
    run_ranks,
    spawn_ranks,
)
from dsv4cp.cp.guard import (
    ENV_VAR,
    RECORD_LEN,
    CollectiveRecord,
    OrderGuard,
    debug_cp_enabled,
    resolve_check_order,
    split_tag,
)


# ---- records ---------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("tag", "shape", "dtype"),
    [
        ("layer3/kv_raw", (4, 512), torch.bfloat16),
        ("final/hidden", (7,), torch.float32),
        ("x" * 100, (1, 2, 3, 4, 5, 6, 7, 8, 9, 10), torch.int32),
        ("ünï/cødé", (0, 3), torch.float8_e4m3fn),
        ("odd/dtype", (2, 2), torch.complex128),
    ],
)
def test_record_round_trip(tag: str, shape: tuple, dtype: torch.dtype) -> None:
    rec = CollectiveRecord.of(11, "all_gather", tag, torch.zeros(shape, dtype=dtype))
    words = rec.encode()
    assert len(words) == RECORD_LEN and all(-(2**63) <= w < 2**63 for w in words)
    back = CollectiveRecord.decode(torch.tensor(words, dtype=torch.int64).tolist())
    assert back.seq == 11 and back.kind == "all_gather" and back.tag_crc == rec.tag_crc
    assert back.dtype_code == rec.dtype_code and back.dtype == rec.dtype
    if len(tag.encode()) <= 64:
        assert back.tag == tag
    else:
        assert back.tag.endswith("…") and tag.startswith(back.tag[:-1])
    if len(shape) <= 8:
        assert back.shape == shape
    assert back._order_key()[1:3] == rec._order_key()[1:3]


def test_decode_rejects_garbage() -> None:
    with pytest.raises(ValueError, match="record"):
        CollectiveRecord.decode([0] * RECORD_LEN)


def test_split_tag() -> None:
    assert split_tag("layer3/kv_raw") == ("layer3", "kv_raw")
    assert split_tag("layer1/comp/kv") == ("layer1", "comp/kv")
    assert split_tag("hidden") == ("?", "hidden")


def _records(tags: list[str], shapes: list[tuple] | None = None) -> list[CollectiveRecord]:
    shapes = shapes or [(4, 8)] * len(tags)
    return [CollectiveRecord.of(5, "all_gather", t, torch.zeros(s)) for t, s in zip(tags, shapes)]


def test_verify_names_layer_tensor_seq_and_ranks() -> None:
    guard = OrderGuard(1, 3)
    with pytest.raises(CPOrderError) as info:
        guard.verify(_records(["layer3/kv_raw", "layer3/x", "layer3/kv_raw"]))
    msg = str(info.value)
    assert "collective #5" in msg and "rank 1 of 3" in msg and "disagree on tag" in msg
    assert "'layer3/kv_raw' (layer 'layer3', tensor 'kv_raw')" in msg
    assert "rank 1: #5 all_gather 'layer3/x'" in msg and "rank 2: same as rank 0" in msg
    assert info.value.seq == 5 and info.value.tags[1] == "layer3/x"
    assert info.value.fields == ("tag",)
    again = pickle.loads(pickle.dumps(info.value))
    assert str(again) == msg and again.tags == info.value.tags


def test_verify_shape_only_mode() -> None:
    guard = OrderGuard(0, 2)
    guard.verify(_records(["a/x", "b/y"]), check_tags=False)  # tags may differ
    with pytest.raises(CPOrderError, match="disagree on shape") as info:
        guard.verify(_records(["a/x", "b/y"], [(4, 8), (5, 8)]), check_tags=False)
    assert "tag" not in info.value.fields and "pad with CPLayout.shard" in str(info.value)


def test_env_var(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ENV_VAR, raising=False)
    assert not debug_cp_enabled() and not resolve_check_order(False)
    assert resolve_check_order(True) and not resolve_check_order(None)
    monkeypatch.setenv(ENV_VAR, "1")
    assert debug_cp_enabled() and resolve_check_order(False) and resolve_check_order(None)
    assert FakeCPWorld(2, check_order=False).check_order
    monkeypatch.setenv(ENV_VAR, "0")
    assert not FakeCPWorld(2, check_order=False).check_order


# ---- fake world ------------------------------------------------------------------------------
def _swapped_order(group: CPGroup) -> None:
    group.all_gather(torch.zeros(4, 8), tag="layer0/kv_raw")  # agree on the first one
    first, second = (
        ("layer1/kv_raw", "layer1/x") if group.rank == 0 else ("layer1/x", "layer1/kv_raw")
    )
    group.all_gather(torch.zeros(4, 8), tag=first)
    group.all_gather(torch.zeros(4, 8), tag=second)


def test_fake_order_mismatch_raises_on_every_rank() -> None:
    seen: dict[int, CPOrderError] = {}

    def fn(group: CPGroup) -> None:
        try:
            _swapped_order(group)
        except CPOrderError as e:
            seen[group.rank] = e
            raise

    with pytest.raises(CPOrderError, match="layer1/kv_raw") as info:
        run_ranks(FakeCPWorld(2, timeout_s=10), fn)
    assert sorted(seen) == [0, 1]
    for r, e in seen.items():
        msg = str(e)
        assert "collective #1" in msg and f"detected on rank {r}" in msg
        assert "layer 'layer1', tensor 'kv_raw'" in msg and "layer 'layer1', tensor 'x'" in msg
        assert "previous collective" in msg and "layer0/kv_raw" in msg
    assert info.value.seq == 1


def test_fake_skipped_collective_and_kind_mismatch() -> None:
    def skip(group: CPGroup) -> None:
        if group.rank != 1:
            group.all_gather(torch.zeros(2), tag="layer4/comp_kv")
        group.all_gather(torch.zeros(2), tag="layer4/kv_raw")

    with pytest.raises(CPOrderError, match="(?s)#0.*layer4/comp_kv.*layer4/kv_raw"):
        run_ranks(FakeCPWorld(3, timeout_s=10), skip)

    def kinds(group: CPGroup) -> None:
        if group.rank == 0:
            group.barrier()
        else:
            group.all_gather(torch.zeros(2), tag="layer0/x")

    with pytest.raises(CPOrderError, match="kind"):
        run_ranks(FakeCPWorld(2, timeout_s=10, check_order=False), kinds)


def test_fake_without_guard_tolerates_tags(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ENV_VAR, raising=False)

    def fn(group: CPGroup) -> torch.Tensor:
        return group.all_gather(torch.full((1,), group.rank), tag=f"t{group.rank}")

    out = run_ranks(FakeCPWorld(2, check_order=False), fn)
    assert out[0].tolist() == [0, 1]


def test_debug_log_has_sequence_numbers(caplog: pytest.LogCaptureFixture) -> None:
    def fn(group: CPGroup) -> None:
        group.all_gather(torch.zeros(1), tag="layer2/x")
        group.all_gather(torch.zeros(1), tag="layer2/y")

    with caplog.at_level(logging.DEBUG, logger="dsv4cp.cp"):
        run_ranks(FakeCPWorld(2), fn)
    text = caplog.text
    assert "[cp rank 0/2] #0 all_gather 'layer2/x'" in text
    assert "[cp rank 1/2] #1 all_gather 'layer2/y'" in text


# ---- gloo: the record all-gather -------------------------------------------------------------
def _catch(fn, *args, **kwargs) -> str | None:
    try:
        fn(*args, **kwargs)
    except CPOrderError as e:
        return str(e)
    return None


def _gloo_guard_worker(group: TorchDistCPGroup) -> dict:
    r = group.rank
    out: dict = {"check_order": group.check_order}
    z = torch.zeros(4, 8)
    ag = group.all_gather
    out["ok0"] = ag(z, tag="layer0/kv_raw").shape == (8, 8)
    out["swap"] = _catch(ag, z, tag="layer1/kv_raw" if r == 0 else "layer1/x")
    out["shape"] = _catch(ag, torch.zeros(4 + r, 8), tag="layer2/x")
    out["dtype"] = _catch(ag, z.to(torch.bfloat16 if r else torch.float32), tag="layer2/y")
    out["kind"] = _catch(group.barrier) if r == 0 else _catch(ag, z, tag="layer3/x")
    # the process group is still healthy after all of the above
    out["after"] = ag(torch.full((1,), float(r)), tag="final/hidden").tolist()
    # guard off (env cleared): tags may differ, gloo still checks shapes
    os.environ.pop(ENV_VAR, None)
    loose = TorchDistCPGroup(None, check_order=False)
    out["loose_flags"] = (loose.check_order, loose.check_shapes)
    out["loose_tag"] = loose.all_gather(torch.full((1,), float(r)), tag=f"r{r}").tolist()
    out["loose_shape"] = _catch(loose.all_gather, torch.zeros(1 + r), tag="layer5/kv_raw")
    os.environ[ENV_VAR] = "1"
    out["env_on"] = TorchDistCPGroup(None, check_order=False).check_order
    return out


def test_gloo_order_guard() -> None:
    results = spawn_ranks(2, _gloo_guard_worker, timeout_s=30, check_order=True)
    for r, res in enumerate(results):
        assert res["check_order"] and res["ok0"]
        assert "collective #1" in res["swap"] and f"detected on rank {r}" in res["swap"]
        assert "'layer1/kv_raw' (layer 'layer1', tensor 'kv_raw')" in res["swap"]
        assert "'layer1/x' (layer 'layer1', tensor 'x')" in res["swap"]
        assert "disagree on shape" in res["shape"] and "(5, 8)" in res["shape"]
        assert "disagree on dtype" in res["dtype"] and "bfloat16" in res["dtype"]
        assert "kind" in res["kind"] and "barrier" in res["kind"]
        assert res["after"] == [0.0, 1.0]
        assert res["loose_flags"] == (False, True)
        assert res["loose_tag"] == [0.0, 1.0]
        assert "layer5/kv_raw" in res["loose_shape"] and "shape" in res["loose_shape"]
        assert res["env_on"]
