"""The model's forward on the torch route reads no tensor values on the host (docs/architecture.md:
`ops` have no host syncs, so the route can run inside a CUDA graph capture). Checked on the CPU
with a dispatch mode over every `DeepseekV41Model.forward` (attention, mHC, MoE, Engram, the
final gather): the released fixture in qat (quantized caches, a cached prefix) and the tiny
random model without quantization. The one host read allowed is the documented one: Engram's
table rows are gathered on the host (`ops.engram.gather_table_rows`, docs/model.md; a model with
Engram layers is refused by graph capture)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from dsv4cp import model
from dsv4cp.tools.checking import Scenario, run_scenario
from tests.host_syncs import HostSyncs
from tests.model.dsv41_fixture import CHECKPOINT

HOST_TABLE_READ = "gather_table_rows"


@pytest.fixture
def recorded(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[tuple[str, str]]]:
    found: list[tuple[str, str]] = []
    calls = []
    forward = model.DeepseekV41Model.forward

    def watched(self, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
        calls.append(1)
        with HostSyncs() as mode:
            out = forward(self, *args, **kwargs)
        found.extend(mode.ops)
        return out

    monkeypatch.setattr(model.DeepseekV41Model, "forward", watched)
    yield found
    assert calls, "no model forward ran"


@pytest.mark.parametrize(
    "scenario",
    [
        dict(checkpoint=str(CHECKPOINT), quant="qat", dtype="bfloat16", prefix=(0, 17)),
        dict(quant="none", prefix=(0, 9)),
    ],
    ids=["fixture-qat", "tiny-none"],
)
def test_model_forward_reads_nothing_on_the_host(recorded: list, scenario: dict) -> None:
    run_scenario(Scenario(lens=(40, 75), **scenario))
    unexpected = [(op, where) for op, where in recorded if not where.endswith(HOST_TABLE_READ)]
    assert not unexpected, sorted(set(unexpected))
