"""The SGLang adapter's GPU path without sglang: `ServingEngine` driven by a stand-in ForwardBatch
(the fields `forward_batch.from_forward_batch` reads) and SGLang-style token slots, with the
multistream executors and breakable graphs for the batches that fit a bucket, CP 1 and 2
(FakeCPGroup, chosen per batch through `SGLangCP.group_for`): equal to `PrefillRunner` eager on
the same requests (extends, a chunk continuing a prefix, a mixed batch, decode, a batch above
the largest bucket that falls back to eager)."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
import torch

from dsv4cp.config import DeepseekV41Config
from dsv4cp.cp.launch import run_cp
from dsv4cp.graphs.runner import GraphConfig
from dsv4cp.integrations.sglang.cp import SGLangCP
from dsv4cp.integrations.sglang.engine import ServingEngine
from dsv4cp.integrations.sglang.forward_batch import from_forward_batch
from dsv4cp.integrations.sglang.server_args import CPSettings
from dsv4cp.model import DeepseekV41Model
from dsv4cp.runner import PrefillRunner

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

TOL = 1e-4  # fp32; graph buckets may pick other GEMM kernels than the live rows


@dataclass
class Mode:
    decode: bool

    def is_idle(self) -> bool:
        return False

    def is_decode(self) -> bool:
        return self.decode

    def is_target_verify(self) -> bool:
        return False

    def is_draft_extend_v2(self) -> bool:
        return False

    def is_extend(self) -> bool:
        return not self.decode

    def is_mixed(self) -> bool:
        return False


@dataclass
class StandInForwardBatch:
    """What the adapter reads of SGLang's ForwardBatch (0.5.23 field names)."""

    forward_mode: Mode
    input_ids: torch.Tensor
    out_cache_loc: torch.Tensor
    positions: torch.Tensor
    req_pool_indices: torch.Tensor
    seq_lens: torch.Tensor
    extend_seq_lens: torch.Tensor | None
    extend_prefix_lens: torch.Tensor | None
    req_pool_indices_cpu: torch.Tensor | None = None
    seq_lens_cpu: torch.Tensor | None = None
    extend_seq_lens_cpu: torch.Tensor | None = None
    extend_prefix_lens_cpu: torch.Tensor | None = None


@dataclass
class StandInScheduler:
    """SGLang's side: a request-row table of int32 token slots, slots handed out from 1."""

    rows: int = 8
    context: int = 512
    req_to_token: torch.Tensor = field(init=False)
    row_of: dict[str, int] = field(default_factory=dict)
    lens: dict[str, int] = field(default_factory=dict)
    next_slot: int = 1

    def __post_init__(self) -> None:
        self.req_to_token = torch.zeros(self.rows, self.context, dtype=torch.int32, device="cuda")

    def batch(self, new: dict[str, list[int]], decode: bool = False) -> StandInForwardBatch:
        rows, prefix, lens, ids, slots, pos = [], [], [], [], [], []
        for rid, toks in new.items():
            row = self.row_of.setdefault(rid, len(self.row_of))
            start = self.lens.get(rid, 0)
            s = torch.arange(self.next_slot, self.next_slot + len(toks), dtype=torch.int32)
            self.next_slot += len(toks)
            self.req_to_token[row, start : start + len(toks)] = s.cuda()
            self.lens[rid] = start + len(toks)
            rows.append(row)
            prefix.append(start)
            lens.append(len(toks))
            ids += toks
            slots.append(s)
            pos.append(torch.arange(start, start + len(toks)))

        def dev(x: list[int]) -> torch.Tensor:
            return torch.tensor(x, device="cuda")

        seq = [p + n for p, n in zip(prefix, lens)]
        return StandInForwardBatch(
            forward_mode=Mode(decode),
            input_ids=dev(ids),
            out_cache_loc=torch.cat(slots).long().cuda(),
            positions=torch.cat(pos).cuda(),
            req_pool_indices=dev(rows),
            seq_lens=dev(seq),
            extend_seq_lens=None if decode else dev(lens),
            extend_prefix_lens=None if decode else dev(prefix),
            req_pool_indices_cpu=torch.tensor(rows),
            seq_lens_cpu=torch.tensor(seq),
            extend_seq_lens_cpu=None if decode else torch.tensor(lens),
            extend_prefix_lens_cpu=None if decode else torch.tensor(prefix),
        )


def _tokens(n: int, seed: int) -> list[int]:
    return torch.randint(0, 512, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


# (requests of one forward, decode?): extends, a chunk after a prefix with a new request
# (mixed prefill), decode of every request, a 200-token chunk above the largest bucket.
STEPS = [
    ({"a": 40, "b": 9}, False),
    ({"a": 7, "c": 100}, False),
    ({"a": 1, "b": 1, "c": 1}, True),
    ({"b": 200}, False),
]


def _run(group, multistream: str, graphs: bool):  # noqa: ANN001
    model = DeepseekV41Model(DeepseekV41Config.tiny(), device="cuda", seed=2)
    gcfg = GraphConfig(buckets=(16, 64, 128), max_requests=4, max_context=512) if graphs else None
    engine = ServingEngine(
        model, multistream=multistream, graphs=gcfg, capture_barrier=group.barrier
    )
    sched = StandInScheduler()
    # SGLang counts a batch as a CP prefill from cp new tokens (is_cp_active); else one rank.
    cp = SGLangCP(
        CPSettings(size=group.cp_size, strategy="interleave" if group.cp_size > 1 else None),
        group_factory=lambda: group,
        is_active=lambda fb: not fb.forward_mode.is_decode() and fb.input_ids.numel() >= 2,
    )
    eager = PrefillRunner(model, cp=group, num_slots=4096, max_context=512)
    diffs = []
    for i, (lens, decode) in enumerate(STEPS):
        new = {rid: _tokens(n, 13 * i + ord(rid)) for rid, n in lens.items()}
        fb = sched.batch(new, decode)
        batch = from_forward_batch(fb)
        hidden = engine.forward(batch, sched.req_to_token, cp.group_for(fb), num_slots=4096, page=1)
        got = model.logits(hidden)
        want = eager.prefill(new, return_all_logits=True).all_logits
        assert want is not None
        diffs.append(float((got - want).abs().max() / want.abs().max()))
    runners = engine.graph_runners
    fallbacks = sum(r.fallbacks for r in runners.values())
    return diffs, fallbacks, sorted(runners), engine.executors.streams is not None


@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "graphs"])
@pytest.mark.parametrize("multistream", ["off", "on"])
@pytest.mark.parametrize("cp", [1, 2])
def test_engine_equals_runner(cp: int, multistream: str, graphs: bool) -> None:
    diffs, fallbacks, runners, streams = run_cp(cp, _run, multistream, graphs, backend="fake")[0]
    assert max(diffs) < TOL, diffs
    assert streams == (multistream == "on")
    if graphs:
        # CP batches run on the CP group's graphs, decode on the single-rank group's.
        assert runners == sorted({1, cp})
        assert fallbacks == 1  # the 200-token chunk
    else:
        assert runners == [] and fallbacks == 0
