"""Per-layer peer benchmark (issue 15): dsv4cp's attention layer against SGLang 0.5.23's Hopper
V4.1 path rebuilt from its parts, and against each layer's floor, at V4.1-Flash dims, bf16.

    PYTHONPATH=python python -m benchmarks.layer_peer --out out/layer_peer.json
    PYTHONPATH=/tmp/site:python python -m benchmarks.layer_peer ...    # FlashMLA installed there
    PYTHONPATH=python python -m benchmarks.layer_peer --smoke           # the script, CPU, tiny

One request per case: a cold prefill of 4K / 16K / 64K tokens, and a 16K-token chunk after a
112K- and a 496K-token cached prefix (the caches are filled with random values of their storage
dtype instead of prefilling the prefix). Roles: the Flash config's layers 0 (SWA, the forward's
first layer), 1 (SWA, as every later SWA layer: it finds the window's rows made), 2 (ratio-2 kv +
index source), 3 (ratio-2 top-k reuse), 20 (ratio-1 kv + candidate source), 21 (ratio-1 reuse),
24 (ratio-1 candidate consumer), run in that order so each reads what the earlier ones left.

- dsv4cp: `DeepseekV41Attention.forward` (prepare → sparse attention → output) in its best
  path: `--quant qat` (default; the released numerics, quantized caches: fp8 SWA rows, fp4
  compressed and index rows), best of the serial and multistream executors, each a CUDA-graph
  replay (eager where capture fails). Its ops come through `dsv4cp.routing`: sparse attention is
  FlashMLA's sparse prefill over the chunk-bounded bf16 workspace where `flash_mla` imports
  (`kernels/flashmla.py`; else the Gluon kernel on Hopper, else the Triton kernel over a
  workspace), the index node the fused logits + running top-k over the decoded index-K
  workspace (`kernels/indexer_topk_cached.mqa_topk_cached`).
- peer: the same layer object with its indexer node replaced by SGLang's torch indexer (bf16
  einsum scores, torch.topk; torch candidate publish / consume) and its sparse attention by
  FlashMLA (`flash_mla_sparse_fwd`, legacy SM90 kernels), eager as SGLang runs it, plus the
  bf16 workspace SGLang builds (the window rows every layer, the compressed entries on kv
  sources; timed as a gather). Same projection GEMMs and cache writes as dsv4cp
  (`benchmarks/sglang_peer.py` says what is SGLang's and what is not). Needs `flash_mla`; without
  it the peer is skipped with a message.
- floor: the layer's GEMMs timed in this run (one captured chain) plus its attention FLOPs —
  sparse attention 2·H·(512 + 512) per valid index, indexer 2·H_I·D_I per scored key (a consumer:
  at most its candidate positions) — at the bf16 GEMM rate measured here (8192³).
- components per layer: the indexer step (the layer's fused node, the unfused chunks it
  replaced: `mqa_logits_cached` + selection, peer), sparse attention on the layer's own inputs
  (the layer's routed call = FlashMLA over its workspace incl. building it; the Triton cached
  kernel on the caches; the dense Triton kernel, FlashMLA and, on Hopper, the Gluon sm_90
  kernel on pre-decoded dense rows).
- Layers run in order on one context, so each finds what the earlier ones left in
  `ctx.cross.attention` as in the model's forward: the SWA store's rows, the window's rows, a
  reuse layer its top-k's compressed rows and the FlashMLA workspace of its group's first layer
  (it decodes only its own SWA rows); the run's first layer starts empty on every call (it
  numbers the window and the store's rows).
- CP rows (case chunk16k@112k): rank 0's time at CP = 4 and 8 (`SoloCPGroup`: one GPU, gathers
  tile the local shard; compute only; best of the executors, each named) against (CP 1 time) /
  N. Each of `--cp-repeats` repeats runs a CP 1 pass, then the ranks: the CP 1 time is the mean
  of all CP 1 samples (the first pass's too), the rank time the median of the repeats', and
  each repeat's ratio is kept with their min and max. `auto_*`: the same for the executor that
  the `auto` multistream policy runs for the role at the rank's rows inside graphs (what
  SGLang's default and `PrefillRunner(multistream="auto")` run); the CP targets are judged on
  it. `forward_mix`: the CP rows summed over the config's whole layer mix, each layer as its
  role's measured layer (`benchmarks/forward_mix.py`): a forward's attention per rank.
- `--keep-bf16-weights`: the layers hold bf16 copies of their fp8 projections
  (`Linear.keep_dequantized`, what $DSV4CP_KEEP_BF16_WEIGHTS asks of the loader), so the GEMMs
  skip the per-call weight dequantization; the peer shares the layer's projections, so both.

Every case and layer is guarded: a failure is printed and recorded, the run goes on, and the
JSON is written at the end (also when `--budget-s` runs out: the rest is marked skipped). A
`--layers` list that cannot run (not in model order, or without the layer whose top-k or
candidates one of them reads) is refused before any work.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import sys
import traceback
from typing import Any

import torch

from benchmarks import sglang_peer
from benchmarks.layer_peer_cp import cp_rank_rows
from benchmarks.layer_peer_report import report, row_brief
from benchmarks.layer_peer_setup import (
    CASES,
    CP_CASE,
    CP_SIZES,
    LAYERS,
    SMOKE_CASES,
    SMOKE_CP_CASE,
    SMOKE_LAYERS,
    Budget,
    Timer,
    attention_backend,
    build_layers,
    dense_attention_args,
    error_text,
    gemm_chain,
    has_flashmla,
    layer_list_problem,
    make_context,
    measure_ceiling,
    patched,
    release_memory,
    sweep_fused,
    triton_attention,
    triton_cached,
    triton_over_workspace,
    unfused_logits_topk,
)
from dsv4cp import ops, routing
from dsv4cp.config import DeepseekV41Config
from dsv4cp.context import AttentionMemo, ForwardContext
from dsv4cp.executors import SERIAL, Executor, MultistreamExecutor, StreamPool
from dsv4cp.kernels.attention_gluon import gluon_attention_available
from dsv4cp.kernels.attention_gluon_halves import sparse_attention_gluon_halves
from dsv4cp.layers import attention as layer_module
from dsv4cp.layers.attention import DeepseekV41Attention
from dsv4cp.layers.linear import keep_dequantized_weights
from dsv4cp.ops.quant import QuantMode
from dsv4cp.schedule import PrepareState, lanes_of

# ------------------------------------------------------------------------------ one case


class Run:
    def __init__(self, args: argparse.Namespace, cfg: DeepseekV41Config) -> None:
        """`cfg`: the tiny config for --smoke, else Flash (`main` picks it once)."""
        self.smoke = args.smoke
        self.device = "cpu" if args.smoke else "cuda"
        self.dtype = torch.bfloat16
        self.cfg = cfg
        self.layer_ids: tuple[int, ...]
        if args.smoke:
            self.cases, self.layer_ids, self.cp_case = SMOKE_CASES, SMOKE_LAYERS, SMOKE_CP_CASE
        else:
            self.cases, self.layer_ids, self.cp_case = CASES, LAYERS, CP_CASE
        if args.layers:
            self.layer_ids = tuple(int(v) for v in args.layers.split(","))
        self.timer = Timer(self.device, args.iters, args.target_s)
        self.cp_repeats = args.cp_repeats
        self.sweep = args.sweep and not args.smoke
        self.budget = Budget(args.budget_s)
        self.quant: QuantMode = args.quant
        self.layers = build_layers(
            self.cfg, self.layer_ids, self.dtype, self.device, quant=self.quant
        )
        self.kept_bytes = 0  # bf16 copies of the fp8 projections (`--keep-bf16-weights`)
        if args.keep_bf16_weights:
            self.kept_bytes = sum(keep_dequantized_weights(a) for a in self.layers.values())
            print(f"kept bf16 copies of the layers' fp8 weights: {self.kept_bytes / 2**20:.1f} MiB")
        self.executors: dict[str, Executor] = {"serial": SERIAL}
        self.streams: StreamPool | None = None
        if self.device == "cuda":
            self.streams = StreamPool(
                lanes_of([a.schedule() for a in self.layers.values()]), torch.device("cuda")
            )
            self.executors["multistream"] = MultistreamExecutor(self.streams)
        self.flashmla = has_flashmla()
        self.peer = args.peer and (self.flashmla or self.smoke)
        if args.peer and not self.peer:
            print("peer skipped: flash_mla does not import (install sgl-flash-mla 1.0.0)")
        self.ceiling = measure_ceiling(self.device, self.smoke)
        print(f"bf16 GEMM ceiling: {self.ceiling:.1f} TFLOP/s", flush=True)

    # -------------------------------------------------------------- per layer
    def layer_row(
        self, case: str, ctx: ForwardContext, x: torch.Tensor, layer: DeepseekV41Attention
    ) -> dict[str, Any]:
        role = layer.role
        prefix, tokens = self.cases[case]
        row: dict[str, Any] = dict(
            case=case, prefix=prefix, tokens=tokens, layer=layer.layer, role=role.name
        )
        record: dict[str, Any] = {}

        def record_index(lay: DeepseekV41Attention, st: PrepareState) -> None:
            record["idx"] = PrepareState(st.ctx, idx_q=st["idx_q"], idx_w=st["idx_w"])
            DeepseekV41Attention._logits_topk(lay, st)

        routed = layer_module.sparse_attention_cached

        def record_attention(*a: Any, **kw: Any) -> torch.Tensor:
            record["attn"], record["attn_kw"] = a, kw
            return routed(*a, **kw)

        with patched(
            layer,
            logits_topk=record_index if role.index_source else None,
            attention=record_attention,
        ):
            self.forward(layer, x, ctx)  # also leaves this layer's records for the later layers
        timed = self.executor_times(layer, x, ctx)
        name = min(timed, key=lambda k: timed[k][0])
        row["dsv4cp_ms"], row["dsv4cp_path"] = timed[name][0], f"{timed[name][1]} {name}"
        self.forward(layer, x, ctx)  # later layers read records made eagerly, not in a graph
        row["dsv4cp_indexer"] = "fused (layer)" if role.index_source else "-"
        row["dsv4cp_attention"] = attention_backend(record["attn"][0])
        self.components(row, ctx, layer, record)
        if self.peer:
            self.peer_time(row, ctx, x, layer, record)
        run, flops = gemm_chain(layer, x)
        row["gemm_ms"] = self.timer(run)[0]
        row["gemm_tflops"] = flops / (row["gemm_ms"] * 1e-3) / 1e12
        work = row["attn_flops"] + row.get("idx_flops", 0.0)
        row["floor_ms"] = row["gemm_ms"] + work / (self.ceiling * 1e12) * 1e3
        row["dsv4cp_over_floor"] = row["dsv4cp_ms"] / row["floor_ms"]
        if "peer_ms" in row:
            row["dsv4cp_over_peer"] = row["dsv4cp_ms"] / row["peer_ms"]
            row["speedup_vs_peer"] = row["peer_ms"] / row["dsv4cp_ms"]
        return row

    def forward(
        self,
        layer: DeepseekV41Attention,
        x: torch.Tensor,
        ctx: ForwardContext,
        executor: Executor = SERIAL,
    ) -> torch.Tensor:
        """The layer's forward; the run's first layer starts from an empty `ctx.cross.attention`
        (in the model the forward's first layer numbers the window's rows; every call here
        does), the others find what the layers before them left, as in the model."""
        if layer.layer == self.layer_ids[0]:
            ctx.cross.attention = AttentionMemo()
        return layer.forward(x, ctx, executor)

    def components(
        self, row: dict[str, Any], ctx: ForwardContext, layer: DeepseekV41Attention, rec: dict
    ) -> None:
        cfg, role = layer.config, layer.role
        q, kv, idx, sink, scale = dense_attention_args(rec["attn"])
        valid = int((idx >= 0).sum().item())
        row["attn_keys_per_row"] = valid / max(1, idx.shape[0])
        row["attn_flops"] = 2.0 * layer.n_heads * (2 * layer.head_dim) * valid
        cached = rec["attn"]  # built afresh each call: not the workspace the next layer reuses
        cached_kw = {k: v for k, v in rec["attn_kw"].items() if k != "workspace_memo"}
        row["attn_layer_ms"] = self.timer(
            lambda: routing.sparse_attention_cached(*cached, **cached_kw)
        )[0]
        if not self.smoke:
            row["attn_triton_cached_ms"] = self.timer(lambda: triton_cached(*cached))[0]
            row["attn_triton_ws_ms"] = self.timer(
                lambda: triton_over_workspace(*cached, **cached_kw)
            )[0]
        attn_triton = routing.sparse_attention if self.smoke else triton_attention
        row["attn_triton_ms"] = self.timer(lambda: attn_triton(q, kv, idx, sink, scale))[0]
        if self.flashmla:
            row["attn_flashmla_ms"] = self.timer(
                lambda: sglang_peer.flashmla_sparse_attention(q, kv, idx, sink, scale)
            )[0]
            row["triton_vs_flashmla"] = row["attn_flashmla_ms"] / row["attn_triton_ms"]
        if gluon_attention_available(q):  # the routed Gluon kernel on the same decoded rows
            row["attn_gluon_ms"] = self.timer(
                lambda: sparse_attention_gluon_halves(q, kv, idx, sink, scale)
            )[0]
            if self.flashmla:
                row["gluon_vs_flashmla"] = row["attn_flashmla_ms"] / row["attn_gluon_ms"]
        if not role.index_source:
            return
        st = rec["idx"]
        r = role.ratio
        n_vis = ctx.local.n_visible(r)
        scored = n_vis.clamp(max=cfg.candidate_topk_blocks * cfg.candidate_block_size)
        n_eff = scored if role.candidate_consumer else n_vis
        row["idx_flops"] = 2.0 * cfg.index_n_heads * cfg.index_head_dim * float(n_eff.sum())
        saved = (dict(ctx.cross.topk), dict(ctx.cross.candidates))
        memo = dataclasses.replace(ctx.cross.attention)  # rows from dsv4cp's top-k, not the peer's
        fused = lambda: DeepseekV41Attention._logits_topk(layer, st)  # noqa: E731
        unfused_logits_topk(layer, st)
        want = ctx.cross.topk[r]
        fused()
        row["fused_rows_identical"] = float((ctx.cross.topk[r] == want).all(1).float().mean())
        row["idx_unfused_ms"] = self.timer(lambda: unfused_logits_topk(layer, st))[0]
        row["idx_layer_ms"] = row["idx_fused_ms"] = self.timer(fused)[0]
        if self.sweep:
            row["idx_fused_sweep"] = sweep_fused(self.timer, ctx, layer, st)
        if self.peer:
            row["idx_peer_ms"] = self.timer(
                lambda: sglang_peer.peer_logits_topk(layer, st), graph=False
            )[0]
        ctx.cross.topk.update(saved[0])
        ctx.cross.candidates.update(saved[1])
        ctx.cross.attention = memo

    def peer_time(
        self,
        row: dict[str, Any],
        ctx: ForwardContext,
        x: torch.Tensor,
        layer: DeepseekV41Attention,
        rec: dict[str, Any],
    ) -> None:
        saved = (dict(ctx.cross.topk), dict(ctx.cross.candidates))
        memo = dataclasses.replace(ctx.cross.attention)  # rows from dsv4cp's top-k, not the peer's
        dense_attention = (
            sglang_peer.flashmla_sparse_attention if self.flashmla else ops.sparse_attention
        )
        # the peer attends over its bf16 workspace, built (and timed) apart below
        dense = dense_attention_args(rec["attn"])

        def attention(*_: Any, **__: Any) -> torch.Tensor:
            return dense_attention(*dense)

        index = sglang_peer.peer_logits_topk if layer.role.index_source else None
        with patched(layer, logits_topk=index, attention=attention):
            row["peer_layer_ms"] = self.timer(lambda: self.forward(layer, x, ctx), graph=False)[0]
        ctx.cross.topk.update(saved[0])
        ctx.cross.candidates.update(saved[1])
        ctx.cross.attention = memo
        swa, comp = sglang_peer.workspace_rows(layer, ctx)
        cache, src = ctx.cache, layer.role.kv_source
        swa_pool = cache.swa[layer.layer]
        row["peer_workspace_ms"] = self.timer(lambda: swa_pool.index_select(0, swa))[0]
        if comp is not None and src is not None:
            comp_pool = cache.compressed[src]
            row["peer_workspace_ms"] += self.timer(lambda: comp_pool.index_select(0, comp))[0]
        row["peer_ms"] = row["peer_layer_ms"] + row["peer_workspace_ms"]

    # -------------------------------------------------------------- per case
    def case_rows(self, case: str, rows: list[dict[str, Any]], cp_rows: list[dict[str, Any]]):
        prefix, tokens = self.cases[case]
        print(f"case {case}: prefix {prefix}, {tokens} new tokens", flush=True)
        ctx = make_context(self.cfg, prefix, tokens, self.device, self.dtype, self.quant)
        x = torch.randn(tokens, self.cfg.hidden_size, device=self.device, dtype=self.dtype)
        cp1: dict[int, float] = {}
        for i in self.layer_ids:
            layer = self.layers[i]
            if self.budget.left() <= 0:
                rows.append(dict(case=case, layer=i, role=layer.role.name, error="time budget"))
                continue
            try:
                row = self.layer_row(case, ctx, x, layer)
                cp1[i] = row["dsv4cp_ms"]
                print("   ", row_brief(row), flush=True)
            except Exception as exc:  # keep going: the other layers and cases still count
                traceback.print_exc()
                row = dict(case=case, layer=i, role=layer.role.name, error=error_text(exc))
                release_memory(self.device)
            rows.append(row)
        if case == self.cp_case:
            for n in (2,) if self.smoke else CP_SIZES:
                cp_rank_rows(self, case, ctx, x, n, cp1, cp_rows)
        del ctx, x
        release_memory(self.device)

    def executor_times(
        self, layer: DeepseekV41Attention, x: torch.Tensor, ctx: ForwardContext
    ) -> dict[str, tuple[float, str]]:
        """Each executor's time of the layer's forward, and how it was timed (graph / eager)."""
        return {
            name: self.timer(lambda ex=ex: self.forward(layer, x, ctx, ex))
            for name, ex in self.executors.items()
        }

    def times_between_forwards(
        self, layer: DeepseekV41Attention, x: torch.Tensor, ctx: ForwardContext
    ) -> dict[str, float]:
        """`executor_times` (ms) between eager forwards that leave the layer's records for the
        later layers."""
        self.forward(layer, x, ctx)
        times = {name: ms for name, (ms, _) in self.executor_times(layer, x, ctx).items()}
        self.forward(layer, x, ctx)  # eager records for the later layers
        return times


# ------------------------------------------------------------------------------ main


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", default="", help=f"comma list of {', '.join(CASES)} (default all)")
    ap.add_argument("--layers", default="", help=f"comma list of layer ids (default {LAYERS})")
    ap.add_argument("--iters", type=int, default=10, help="timed calls at most per measurement")
    ap.add_argument("--target-s", type=float, default=0.5, help="seconds per measurement, about")
    ap.add_argument("--budget-s", type=float, default=280.0, help="stop starting work after this")
    ap.add_argument(
        "--quant", choices=("qat", "none"), default="qat", help="numerics and cache formats"
    )
    ap.add_argument("--sweep", action="store_true", help="also time the fused kernel's configs")
    ap.add_argument("--no-peer", dest="peer", action="store_false")
    ap.add_argument("--no-cp", dest="cp", action="store_false")
    ap.add_argument(
        "--keep-bf16-weights",
        action="store_true",
        help="hold bf16 copies of the fp8 projections (no per-call dequantization; both paths)",
    )
    ap.add_argument(
        "--cp-repeats",
        type=int,
        default=1,
        help="CP rows: repeats of (a CP 1 pass, then the ranks) per CP size; median and spread",
    )
    ap.add_argument("--smoke", action="store_true", help="CPU, tiny config, torch peer parts")
    ap.add_argument("--out", default="out/layer_peer.json")
    args = ap.parse_args(argv)
    if args.cp_repeats < 1:
        print(f"layer_peer: --cp-repeats must be ≥ 1, got {args.cp_repeats}", file=sys.stderr)
        return 2
    if not args.smoke and not torch.cuda.is_available():
        print("layer_peer: needs a CUDA GPU (or --smoke)", file=sys.stderr)
        return 2
    cfg = DeepseekV41Config.tiny() if args.smoke else DeepseekV41Config.flash()
    problem = layer_list_problem(cfg, args.layers) if args.layers else None
    if problem:
        print(f"layer_peer: --layers {args.layers}: {problem}", file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")  # backend choices
    torch.manual_seed(0)
    rows: list[dict[str, Any]] = []
    cp_rows: list[dict[str, Any]] = []
    run: Run | None = None
    try:
        run = Run(args, cfg)
        names = [c for c in args.cases.split(",") if c] or list(run.cases)
        unknown = [c for c in names if c not in run.cases]
        if unknown:
            print(f"layer_peer: unknown cases {unknown}; known: {list(run.cases)}", file=sys.stderr)
            return 2
        if not args.cp:
            run.cp_case = ""
        for case in names:
            if run.budget.left() <= 0:
                rows.append(dict(case=case, error="time budget"))
                continue
            try:
                run.case_rows(case, rows, cp_rows)
            except Exception as exc:  # the case's set-up failed (memory?): record, go on
                traceback.print_exc()
                rows.append(dict(case=case, error=error_text(exc)))
                release_memory(run.device)
    finally:
        report(args, run, rows, cp_rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
