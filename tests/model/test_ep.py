"""Expert parallelism (docs/ep.md): EP = N equals EP = 1.

- The MoE layer alone: rows split over N fake ranks (with CP padding rows) through the EP
  exchange equal one rank holding every expert, bit for bit, in `none` (fp32) and `qat` (bf16):
  each expert's GEMMs see the same rows in the same order, and the combine is EP = 1's.
- The whole tiny model with CP = N and EP over the same ranks: in `qat` bit for bit against
  CP = 1, EP = 1 (the tiny 12-expert config in released storage, N = 2, 3, 4) and against CP = N
  without EP (the released-format fixture, 8 experts, N = 2, 4: what EP alone changes; below),
  in `none` within CP's fp32 tolerance of CP = 1 (CP itself moves the dense GEMMs' row
  counts). Fake ranks and gloo processes; the order guard is on throughout.
- The loader reads only a rank's experts; random weights give every rank EP = 1's values.
"""

from __future__ import annotations

import os
import time
from dataclasses import replace

import pytest
import torch

from dsv4cp.cli import main as cli_main
from dsv4cp.cp.fake import FakeCPWorld, run_ranks
from dsv4cp.cp.group import CPGroup
from dsv4cp.cp.guard import CPOrderError
from dsv4cp.cp.launch import CPLaunchError, spawn_ranks
from dsv4cp.layers.moe import MoE, expert_range
from dsv4cp.loader import EP_SKIPPED, load_checkpoint
from dsv4cp.model import DeepseekV41Model
from dsv4cp.random_weights import init_random_
from dsv4cp.tools.checking import (
    Scenario,
    compare,
    run_cp_scenario,
    run_scenario,
    summarize,
)
from tests.model import dsv41_fixture as fx
from tests.model.ep_scenarios import differences, fixture_qat, tiny12, tiny12_qat

T = 23  # rows of the layer tests


def _moe(ep: CPGroup | None, quant: bool, dtype: torch.dtype) -> MoE:
    cfg = tiny12(quant)
    moe = MoE(cfg, dtype=dtype, device="cpu", ep=ep, layer=3)
    slots = moe.checkpoint_slots("layers.3.ffn.")
    if moe.ep is not None:
        slots.update(moe.foreign_expert_slots("layers.3.ffn."))
    init_random_(slots, cfg, seed=5)
    moe.gate_bias.normal_(0, 0.3, generator=torch.Generator().manual_seed(1))  # ties unlikely
    return moe


def _layer_rank(group: CPGroup, x: torch.Tensor, quant: str, pad: int) -> torch.Tensor:
    """Interleaved rows of x (token t on rank t mod N) plus `pad` padding rows (id -1)."""
    n, r = group.cp_size, group.rank
    ids = torch.arange(r, x.shape[0], n)
    ids = torch.cat([ids, torch.full((pad,), -1)])
    rows = torch.where((ids >= 0)[:, None], x[ids.clamp(min=0)], 7.0)
    moe = _moe(group, quant == "qat", x.dtype)
    out = moe(rows, quant=quant, backend="loop", row_ids=ids)  # type: ignore[arg-type]
    return out[ids >= 0]


@pytest.mark.parametrize("quant,dtype", [("none", torch.float32), ("qat", torch.bfloat16)])
@pytest.mark.parametrize("n", [2, 3, 4])
def test_moe_layer_ep_equals_ep1_bit_for_bit(n: int, quant: str, dtype: torch.dtype) -> None:
    x = torch.randn(T, 128, generator=torch.Generator().manual_seed(2)).to(dtype)
    want = _moe(None, quant == "qat", dtype)(x, quant=quant, backend="loop")  # type: ignore[arg-type]
    outs = run_ranks(FakeCPWorld(n), _layer_rank, x, quant, 2)
    got = torch.empty_like(want)
    for r, out in enumerate(outs):
        got[r::n] = out
    assert torch.equal(got, want)


def test_expert_range_needs_a_divisor() -> None:
    world = FakeCPWorld(3)
    assert expert_range(12, world.groups[2]) == range(8, 12)
    with pytest.raises(ValueError, match="n_routed_experts=8 is not a multiple of 3"):
        expert_range(8, world.groups[0])


def test_random_weights_match_ep1() -> None:
    full = DeepseekV41Model(tiny12(False), seed=4)
    world = FakeCPWorld(3)
    part = DeepseekV41Model(tiny12(False), seed=4, ep=world.groups[1])
    mine = part.checkpoint_weights()
    ref = full.checkpoint_weights()
    assert set(mine) < set(ref)
    for name, t in mine.items():
        assert torch.equal(t, ref[name]), name
    moe = part.blocks[0].ffn
    assert isinstance(moe, MoE) and moe.experts == range(4, 8) and moe.w1_weight.shape[0] == 4


@pytest.mark.parametrize("n", [2, 3, 4])
def test_whole_model_qat_fake_ep_bit_for_bit(n: int) -> None:
    sc = tiny12_qat()
    want = run_scenario(sc)
    got, _ = run_cp_scenario(replace(sc, ep=True), n, "fake", check_order=True)
    assert any(k.startswith("hidden/") for k in got) and any(k.startswith("topk/") for k in got)
    assert differences(got, want) == {}


# The fixture's EP runs are compared with CP = N runs without EP (the same row split), bit for bit:
# what EP alone changes. Against CP = 1 the fixture's hidden state of layer 6 differed in one
# bf16 element (1 ulp) at CP = 2 on an AMD EPYC (MKL 2024.2, AVX2) with or without EP — a CPU
# summation order that follows the row count, not EP; CP = N against CP = 1 is `check`'s and
# test_cp's subject (within their tolerance there).


@pytest.mark.parametrize("n", [2, 4])
def test_fixture_qat_fake_ep_bit_for_bit(n: int) -> None:
    sc = fixture_qat()
    want, _ = run_cp_scenario(sc, n, "fake", check_order=True)
    got, _ = run_cp_scenario(replace(sc, ep=True), n, "fake", check_order=True)
    assert differences(got, want) == {}


def test_fixture_qat_gloo_ep2_bit_for_bit() -> None:
    sc = fixture_qat(lens=(31, 20))
    want, _ = run_cp_scenario(sc, 2, "fake", check_order=True)
    got, _ = run_cp_scenario(replace(sc, ep=True), 2, "gloo", timeout_s=120, check_order=True)
    assert differences(got, want) == {}


@pytest.mark.parametrize("n,backend", [(2, "fake"), (3, "fake"), (4, "fake"), (3, "gloo")])
def test_whole_model_none_ep_within_cp_tolerance(n: int, backend: str) -> None:
    sc = Scenario(lens=(5, 31), prefix=(0, 3), config=tiny12(False))
    rep = summarize(
        compare(run_scenario(sc), run_cp_scenario(replace(sc, ep=True), n, backend)[0]), 1e-5
    )
    assert rep["pass"] and rep["topk_identical"] and not rep["missing"], rep


def _one_rank_without_ep(group: CPGroup, sc: Scenario) -> None:
    run_scenario(replace(sc, ep=group.rank == 0), group)


def test_order_guard_catches_a_rank_without_ep() -> None:
    sc = Scenario(lens=(5,), config=tiny12(False))
    with pytest.raises(CPOrderError):
        run_ranks(FakeCPWorld(2, timeout_s=20), _one_rank_without_ep, sc)


def test_loader_reads_only_local_experts() -> None:
    world = FakeCPWorld(4)
    full = DeepseekV41Model.from_checkpoint(fx.CHECKPOINT, quant="qat")
    part = DeepseekV41Model(
        full.config, dtype=torch.bfloat16, seed=None, quant="qat", ep=world.groups[3]
    )
    report = load_checkpoint(part, fx.CHECKPOINT)
    n_layers, e = full.config.num_hidden_layers, full.config.n_routed_experts
    assert len(report.skipped[EP_SKIPPED]) == n_layers * (e - e // 4) * 6  # w1/w3/w2 + scales
    ref = full.checkpoint_weights()
    for name, t in part.checkpoint_weights().items():
        assert torch.equal(
            t.view(torch.uint8) if t.dtype.itemsize == 1 else t,
            ref[name].view(torch.uint8) if t.dtype.itemsize == 1 else ref[name],
        ), name

    def routed_bytes(m: DeepseekV41Model) -> int:
        return sum(
            t.numel() * t.element_size()
            for b in m.blocks
            for n_, t in b.ffn.state_dict().items()
            if n_.startswith(("w1_", "w2_", "w3_"))
        )

    assert routed_bytes(part) * 4 == routed_bytes(full)


def test_check_ep_flags(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli_main(["check", "--cp", "3", "--ep", "--lens", "5"]) == 2
    assert "does not divide the model's 8 routed experts" in capsys.readouterr().err
    assert cli_main(["check", "--experts", "12", "--checkpoint", str(fx.CHECKPOINT)]) == 2
    assert "not with --checkpoint" in capsys.readouterr().err
    code = cli_main(
        ["check", "--cp", "3", "--ep", "--experts", "12", "--lens", "5,9", "--cp-backend", "fake"]
    )
    out = capsys.readouterr().out
    assert code == 0 and "(ep=3): PASS" in out, out


def _dies_in_the_exchange(group, sc: Scenario):  # noqa: ANN001 - spawned top-level function
    if group.rank == 1:
        inner = group.all_to_all

        def all_to_all(x, splits, *, tag):  # noqa: ANN001
            if tag == "layer2/ep_dispatch":
                os._exit(3)
            return inner(x, splits, tag=tag)

        group.all_to_all = all_to_all
    return run_scenario(sc, group)


def test_rank_exiting_in_the_ep_exchange_fails_the_others_within_the_timeout() -> None:
    sc = Scenario(lens=(9,), ep=True)
    t0 = time.monotonic()
    with pytest.raises(CPLaunchError, match="rank 1") as info:
        spawn_ranks(2, _dies_in_the_exchange, (sc,), timeout_s=10, check_order=True)
    assert time.monotonic() - t0 < 10 + 10
    assert info.value.failures[0].startswith("raised CPCommError"), info.value.failures
    assert "layer2/ep_" in info.value.failures[0]
