"""CheckpointReader on the fixture checkpoint and on broken copies of it."""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from dsv4cp.checkpoint import (
    CheckpointError,
    CheckpointReader,
    TensorSpec,
    expected_dtype,
    validate_checkpoint,
)
from tests.checkpoint.corrupt import (
    FIXTURE,
    INDEX,
    copy_checkpoint,
    edit_header,
    edit_index,
    shard_of,
    truncate,
)

ENGRAM = "layers.0.engram.embed.weight"
WQ_A = "layers.0.attn.wq_a.weight"


@pytest.fixture
def reader() -> Iterator[CheckpointReader]:
    with CheckpointReader(FIXTURE) as r:
        yield r


def test_names_and_specs_come_from_index_and_headers(reader: CheckpointReader) -> None:
    index = json.loads((FIXTURE / INDEX).read_text())["weight_map"]
    assert reader.names() == sorted(index)
    assert reader.has(WQ_A) and not reader.has("layers.0.attn.bogus")
    assert reader.file_of(WQ_A) == str(FIXTURE / index[WQ_A])
    assert reader.spec(WQ_A) == TensorSpec("F8_E4M3", (64, 128), str(FIXTURE / index[WQ_A]))
    assert reader._open is None  # specs read headers only


def test_get_equals_safetensors_for_every_tensor(reader: CheckpointReader) -> None:
    for file in sorted({reader.file_of(n) for n in reader.names()}):
        with safe_open(file, "pt") as f:
            for name in f.keys():
                got = reader.get(name)
                assert got.dtype == f.get_tensor(name).dtype
                assert torch.equal(got.view(torch.uint8), f.get_tensor(name).view(torch.uint8))


def test_get_checks_the_expected_dtype(reader: CheckpointReader) -> None:
    assert reader.get(WQ_A, dtype=torch.float8_e4m3fn).dtype == torch.float8_e4m3fn
    assert reader.get(WQ_A, dtype="F8_E4M3").shape == (64, 128)
    with pytest.raises(CheckpointError, match=r"wq_a\.weight.* is F8_E4M3, expected BF16"):
        reader.get(WQ_A, dtype=torch.bfloat16)


def test_one_shard_open_at_a_time(reader: CheckpointReader) -> None:
    first, second = "embed.weight", "head.weight"
    assert reader.file_of(first) != reader.file_of(second)
    reader.get(first)
    handle = reader._open[1]
    reader.get(second)
    assert reader._open[0] == reader.file_of(second)
    with pytest.raises(Exception, match="closed"):
        handle.keys()
    reader.close()
    assert reader._open is None
    assert reader.get(first).shape == (256, 128)  # usable after close


def test_memmap_is_a_lazy_view_of_one_tensor(reader: CheckpointReader) -> None:
    mm = reader.memmap(ENGRAM)
    assert isinstance(mm, np.memmap) and mm.dtype == np.uint8
    assert Path(mm.filename) == Path(reader.file_of(ENGRAM)).resolve()
    stored = reader.get(ENGRAM)
    assert mm.shape == tuple(stored.shape)
    raw = Path(reader.file_of(ENGRAM)).read_bytes()
    assert (
        mm.offset > 8
        and raw[mm.offset : mm.offset + mm.size] == stored.view(torch.uint8).numpy().tobytes()
    )
    assert mm.size < len(raw)  # one tensor's bytes, not the shard's
    assert torch.equal(
        torch.from_numpy(np.array(mm)).view(torch.float8_e4m3fn).view(torch.uint8),
        stored.view(torch.uint8),
    )
    rows = torch.tensor([5, 0, 659, 5])
    assert torch.equal(
        reader.read_rows(ENGRAM, rows).view(torch.uint8), stored[rows].view(torch.uint8)
    )
    bf16 = reader.memmap("embed.weight")
    assert bf16.dtype == np.uint16
    assert torch.equal(
        torch.from_numpy(np.array(bf16)).view(torch.bfloat16), reader.get("embed.weight")
    )


def test_single_file_checkpoint(tmp_path: Path) -> None:
    tensors = {"a.weight": torch.randn(3, 4), "b": torch.arange(6, dtype=torch.int8)}
    save_file(tensors, tmp_path / "model.safetensors")
    for path in (tmp_path, tmp_path / "model.safetensors"):
        with CheckpointReader(path) as r:
            assert r.names() == ["a.weight", "b"]
            assert torch.equal(r.get("a.weight"), tensors["a.weight"])


def test_fixture_checkpoint_validates(reader: CheckpointReader) -> None:
    validate_checkpoint(reader)
    assert expected_dtype("layers.3.ffn.experts.7.w2.weight") == "I8"
    assert expected_dtype("mtp.0.main_proj.scale") == "F8_E8M0"
    assert expected_dtype("layers.0.hc_attn_fn") == "F32"
    assert expected_dtype("layers.1.attn.compressor.wgate.weight") == "BF16"
    assert expected_dtype("vision.norm.weight") is None


# ---- broken checkpoints: each a CheckpointError naming the tensor and the file ---------------


def test_missing_directory_contents(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="neither model.safetensors.index.json nor"):
        CheckpointReader(tmp_path)


def test_name_missing_from_the_index(reader: CheckpointReader) -> None:
    with pytest.raises(
        CheckpointError, match=r"tensor 'layers\.0\.attn\.bogus' is not in the checkpoint"
    ):
        reader.get("layers.0.attn.bogus")


def test_missing_shard_file(tmp_path: Path) -> None:
    root = copy_checkpoint(tmp_path / "ckpt")
    shard = shard_of(root, "head.weight")
    shard.unlink()
    with CheckpointReader(root) as r, pytest.raises(CheckpointError) as e:
        r.get("head.weight")
    assert "'head.weight'" in str(e.value) and f"{shard}: shard file is missing" in str(e.value)


@pytest.mark.parametrize("target", [".", "..", ""])
def test_index_entry_that_names_no_file_is_refused(target: str, tmp_path: Path) -> None:
    """weight_map "." was a raw IsADirectoryError on first read."""
    root = copy_checkpoint(tmp_path / "ckpt")
    edit_index(root, lambda m: m.__setitem__(WQ_A, target))
    with pytest.raises(CheckpointError) as e:
        CheckpointReader(root)
    assert f"{root / INDEX}: weight_map maps tensor '{WQ_A}' to {target!r}" in str(e.value)


def test_index_entry_that_is_a_directory(tmp_path: Path) -> None:
    root = copy_checkpoint(tmp_path / "ckpt")
    (root / "sub").mkdir()
    edit_index(root, lambda m: m.__setitem__(WQ_A, "sub"))
    with CheckpointReader(root) as r, pytest.raises(CheckpointError) as e:
        r.spec(WQ_A)
    assert f"cannot read tensor '{WQ_A}': {root / 'sub'}: is a directory" in str(e.value)


def test_unreadable_shard_names_the_file(tmp_path: Path) -> None:
    from dsv4cp.checkpoint.header import read_header

    with pytest.raises(CheckpointError, match=rf"{tmp_path}: is a directory, not a shard file"):
        read_header(tmp_path)


def _within(seconds: float, fn: Callable[[], object], fifo: Path) -> BaseException | None:
    """fn's exception, raised within `seconds`; a call still blocked then fails the test (the
    FIFO is opened for writing once, so the blocked thread can end)."""
    caught: list[BaseException | None] = [None]

    def body() -> None:
        try:
            fn()
        except BaseException as e:  # noqa: BLE001 - handed to the test
            caught[0] = e

    t = threading.Thread(target=body, daemon=True)
    t.start()
    t.join(seconds)
    if t.is_alive():
        os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))  # EOF for the blocked reader
        pytest.fail(f"reading {fifo} blocked for {seconds} s")
    return caught[0]


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="no FIFOs here")
@pytest.mark.parametrize("which", ["shard", "index"])
def test_a_fifo_in_place_of_a_file_is_refused_not_waited_on(which: str, tmp_path: Path) -> None:
    """A named pipe where a shard or the index should be: open() blocked until something wrote
    to it (a hang); now a CheckpointError naming it."""
    root = copy_checkpoint(tmp_path / "ckpt")
    fifo = shard_of(root, WQ_A) if which == "shard" else root / INDEX
    fifo.unlink()
    os.mkfifo(fifo)

    def read() -> None:
        with CheckpointReader(root) as r:
            r.spec(WQ_A)

    e = _within(10.0, read, fifo)
    assert isinstance(e, CheckpointError), e
    assert f"{fifo}: not a regular file" in str(e)


def test_index_points_to_a_shard_without_the_tensor(tmp_path: Path) -> None:
    root = copy_checkpoint(tmp_path / "ckpt")
    other = shard_of(root, "head.weight").name
    edit_index(root, lambda m: m.__setitem__(WQ_A, other))
    with CheckpointReader(root) as r, pytest.raises(CheckpointError) as e:
        r.get(WQ_A)
    assert f"{root / other}: the index maps tensor '{WQ_A}' here but the shard lacks it" in str(
        e.value
    )


def test_truncated_shard_is_detected_before_reading(tmp_path: Path) -> None:
    root = copy_checkpoint(tmp_path / "ckpt")
    shard = shard_of(root, WQ_A)
    truncate(shard, 1)
    with CheckpointReader(root) as r:
        with pytest.raises(
            CheckpointError, match=rf"cannot read tensor '{WQ_A}': {shard}: truncated"
        ):
            r.spec(WQ_A)
        with pytest.raises(CheckpointError, match="truncated"):
            r.memmap(WQ_A)
        assert r._open is None  # nothing was opened


def test_header_sizes_must_match_dtype_and_shape(tmp_path: Path) -> None:
    root = copy_checkpoint(tmp_path / "ckpt")
    edit_header(shard_of(root, WQ_A), lambda h: h[WQ_A].__setitem__("dtype", "BF16"))
    with CheckpointReader(root) as r, pytest.raises(CheckpointError) as e:
        r.get(WQ_A)
    assert f"tensor '{WQ_A}': BF16 [64, 128] needs 16384 bytes" in str(e.value)


# (field, malformed value, what the error says): each was a raw TypeError (or, for the shape
# string, read digit by digit as [3, 2]).
MALFORMED = [
    ("data_offsets", ["0", "128"], "data_offsets must be two integers, got ['0', '128']"),
    ("data_offsets", [0.0, 8192.0], "data_offsets must be two integers, got [0.0, 8192.0]"),
    ("data_offsets", [0, True], "data_offsets must be two integers"),
    ("data_offsets", [0], "data_offsets must be two integers, got [0]"),
    ("dtype", ["BF16"], "dtype must be a string, got ['BF16']"),
    ("shape", "32", "shape must be a list of non-negative integers, got '32'"),
    ("shape", [64.0, 128], "shape must be a list of non-negative integers"),
    ("shape", [True, 128], "shape must be a list of non-negative integers"),
    ("shape", [-64, 128], "shape must be a list of non-negative integers"),
]


@pytest.mark.parametrize("field,value,message", MALFORMED, ids=[str(m[:2]) for m in MALFORMED])
def test_malformed_header_entry_names_file_and_tensor(
    field: str, value: object, message: str, tmp_path: Path
) -> None:
    root = copy_checkpoint(tmp_path / "ckpt")
    shard = shard_of(root, WQ_A)
    edit_header(shard, lambda h: h[WQ_A].__setitem__(field, value))
    with CheckpointReader(root) as r, pytest.raises(CheckpointError) as e:
        r.spec(WQ_A)
    assert f"{shard}: tensor '{WQ_A}': {message}" in str(e.value)
    assert "\n" not in str(e.value)


def test_header_entry_that_is_not_an_object(tmp_path: Path) -> None:
    root = copy_checkpoint(tmp_path / "ckpt")
    shard = shard_of(root, WQ_A)
    edit_header(shard, lambda h: h.__setitem__(WQ_A, None))
    with CheckpointReader(root) as r, pytest.raises(CheckpointError) as e:
        r.spec(WQ_A)
    assert f"{shard}: tensor '{WQ_A}': malformed header entry None" in str(e.value)


def test_wrong_dtype_and_misshaped_scale_fail_validation(tmp_path: Path) -> None:
    root = copy_checkpoint(tmp_path / "ckpt")
    shard = shard_of(root, WQ_A)
    scale = "layers.0.attn.wq_b.scale"

    def edit(h: dict) -> None:
        h[WQ_A]["dtype"] = "I8"  # same size: only the kind check can catch it
        h[scale]["shape"] = [2, 8]  # same bytes, wrong layout

    edit_header(shard, edit)
    with CheckpointReader(root) as r, pytest.raises(CheckpointError) as e:
        validate_checkpoint(r)
    msg = str(e.value)
    assert msg.startswith("2 checkpoint problem(s)")
    assert f"{shard}: tensor '{WQ_A}' is I8, a fp8 tensor must be F8_E4M3" in msg
    weight = "'layers.0.attn.wq_b.weight' [256, 64] (fp8)"
    assert f"{shard}: scale '{scale}' has shape [2, 8], its weight {weight} needs [8, 2]" in msg
