"""CP=N vs CP=1 agreement: the engine behind `dsv4cp check` and `demo`.

The model is the tiny config with the whole V4.1 block (`DeepseekV41Config.tiny_full()`: mHC and a
small MoE around the attention) with seeded random weights, or a released-format checkpoint
(`Scenario.checkpoint`, e.g. the tiny reference fixture: Engram included).

With `Scenario.ep` the CP ranks are also the expert-parallel ranks (`model.ep` = the CP group:
each holds n_routed_experts / N experts, docs/ep.md); CP=1 is then EP=1.

A scenario is a batch of prompts, each with a cached prefix prefilled first and the rest sent in
chunks; every rank runs the same scenario and rank 0 reports logits, per-layer hidden rows of
the last chunk, the last top-k per ratio and every cache (by request position, so slot layouts
need not match).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from dsv4cp.config import (
    EXPORT_MODEL_TYPE,
    UPSTREAM_MODEL_TYPE,
    DeepseekV41Config,
    checkpoint_kind,
    not_a_checkpoint_dir,
)
from dsv4cp.context import ForwardContext
from dsv4cp.cp.group import CPGroup, SingleCPGroup, gather_global
from dsv4cp.graphs.runner import GraphConfig
from dsv4cp.model import DeepseekV41Model, check_supported
from dsv4cp.observe.timing import StageTimer
from dsv4cp.runner import PrefillRunner


def _refuse_an_export(path: str) -> None:
    """A checkpoint is released-format: a dsv4cp export (`export-tiny`: no `.scale` tensors,
    another config layout) is a ValueError saying so, before its weights are tried. An
    unreadable config.json is left to `DeepseekV41Config.from_hf`."""
    try:
        kind = checkpoint_kind(path)
    except (OSError, ValueError):  # unreadable, or another model_type: from_hf / the loader say
        return
    if kind == "export":
        raise ValueError(
            f"{path} is a dsv4cp export (config.json model_type {EXPORT_MODEL_TYPE!r}); "
            "--checkpoint reads released-format DeepSeek-V4.1 checkpoints "
            f"(model_type {UPSTREAM_MODEL_TYPE!r})"
        )


@dataclass(frozen=True)
class Scenario:
    lens: tuple[int, ...]
    prefix: tuple[int, ...] = ()
    chunk: int = 0  # 0 = all new tokens in one chunk
    seed: int = 0
    multistream: bool = False
    graphs: bool = False  # capture the prefill batches as breakable CUDA graphs (CUDA)
    dtype: str = "float32"
    device: str = "cpu"
    config: DeepseekV41Config = field(default_factory=DeepseekV41Config.tiny_full)
    checkpoint: str | None = None  # a released-format checkpoint directory (config from it)
    quant: str = "none"
    ep: bool = False  # expert parallelism over the CP ranks (docs/ep.md)

    def __post_init__(self) -> None:
        if self.checkpoint is not None:
            if os.path.exists(self.checkpoint) and not os.path.isdir(self.checkpoint):
                raise ValueError(not_a_checkpoint_dir(self.checkpoint))
            _refuse_an_export(self.checkpoint)
            object.__setattr__(self, "config", DeepseekV41Config.from_hf(self.checkpoint))
        if not self.lens or any(n < 1 for n in self.lens):
            raise ValueError(f"lens must be positive integers, got {list(self.lens)}")
        prefix = self.prefix or (0,) * len(self.lens)
        if len(prefix) == 1 and len(self.lens) > 1:
            prefix = prefix * len(self.lens)
        if len(prefix) != len(self.lens):
            raise ValueError("--prefix needs one value per length (or a single value)")
        for n, p in zip(self.lens, prefix):
            if not 0 <= p < n:
                raise ValueError(f"prefix {p} must be in [0, {n}) for a prompt of {n} tokens")
        object.__setattr__(self, "prefix", tuple(prefix))
        if self.chunk < 0:
            raise ValueError("chunk must be >= 0")
        try:  # before the CP=1 reference starts, not when its model is built
            check_supported(self.config, self.quant)  # type: ignore[arg-type]
        except NotImplementedError as e:
            if self.checkpoint is None:
                raise ValueError(
                    f"--quant {self.quant} needs a released-format checkpoint's fp8/fp4 storage: "
                    "give --checkpoint DIR, or --quant none for the random test model"
                ) from None
            raise ValueError(f"--quant {self.quant}: {self.checkpoint}: {e}") from None

    def prompts(self) -> list[list[int]]:
        g = torch.Generator().manual_seed(1000 + self.seed)
        v = self.config.vocab_size
        return [torch.randint(0, v, (n,), generator=g).tolist() for n in self.lens]

    def steps(self) -> list[dict[str, list[int]]]:
        """The batches sent in order: prefixes, then the new tokens chunk by chunk."""
        prompts = self.prompts()
        out: list[dict[str, list[int]]] = []
        pre = {f"r{i}": p[:n] for i, (p, n) in enumerate(zip(prompts, self.prefix)) if n}
        if pre:
            out.append(pre)
        rest = {f"r{i}": p[n:] for i, (p, n) in enumerate(zip(prompts, self.prefix))}
        size = self.chunk or max(len(r) for r in rest.values())
        a = 0
        while any(a < len(r) for r in rest.values()):
            out.append({k: r[a : a + size] for k, r in rest.items() if a < len(r)})
            a += size
        return out


class LayerRecorder:
    """A `DeepseekV41Model.layer_hook`: keeps each layer's local output rows of one forward;
    `gathered()` returns them, and the last top-k per ratio, as global rows on every rank."""

    def __init__(self) -> None:
        self.rows: dict[str, Tensor] = {}
        self.ctx: ForwardContext | None = None

    def __call__(self, name: str, h: Tensor, ctx: ForwardContext) -> None:
        self.rows[name] = h
        self.ctx = ctx

    def gathered(self) -> tuple[dict[str, Tensor], dict[int, Tensor]]:
        """Collectives: every rank calls this after the same forward."""
        ctx = self.ctx
        if ctx is None:
            raise ValueError("LayerRecorder.gathered: no forward ran while it was the layer hook")
        with torch.inference_mode():
            layers = {
                k: gather_global(ctx.cp, ctx.layout, v, tag=f"record/{k}")
                for k, v in self.rows.items()
            }
            topk = {
                r: gather_global(ctx.cp, ctx.layout, t, tag=f"record/topk{r}")
                for r, t in sorted(ctx.cross.topk.items())
            }
        return layers, topk


@contextmanager
def recording(model: DeepseekV41Model) -> Iterator[LayerRecorder]:
    """Record every layer's output rows of the forwards run inside (eagerly: see layer_hook)."""
    recorder = LayerRecorder()
    model.layer_hook = recorder
    try:
        yield recorder
    finally:
        model.layer_hook = None


def build_model(sc: Scenario, ep: CPGroup | None = None) -> DeepseekV41Model:
    """The scenario's model: its checkpoint, else `sc.config` with weights seeded by `sc.seed`;
    `ep` the expert-parallel group (only this rank's experts are built and loaded)."""
    dtype = getattr(torch, sc.dtype)
    if sc.checkpoint is not None:
        return DeepseekV41Model.from_checkpoint(
            sc.checkpoint, quant=sc.quant, dtype=dtype, device=sc.device, ep=ep
        )
    return DeepseekV41Model(
        sc.config, dtype=dtype, device=sc.device, seed=sc.seed, quant=sc.quant, ep=ep
    )


def run_scenario(
    sc: Scenario, cp: CPGroup | None = None, *, timer: StageTimer | None = None
) -> dict[str, Tensor]:
    """Run `sc` on this rank; returns CPU tensors keyed by what they are."""
    cp = cp or SingleCPGroup()
    model = build_model(sc, ep=cp if sc.ep else None)
    total = sum(sc.lens)
    graphs = None
    if sc.graphs:
        biggest = max(sum(len(t) for t in b.values()) for b in sc.steps())
        graphs = GraphConfig(
            buckets=(biggest,), max_requests=len(sc.lens), max_context=max(sc.lens)
        )
    runner = PrefillRunner(
        model,
        cp=cp,
        multistream=sc.multistream,
        num_slots=16 * (total // 16 + len(sc.lens) + 2),
        max_requests=max(4, len(sc.lens)),
        max_context=max(sc.lens) + 16,
        page_size=16,
        graphs=graphs,
    )
    res: dict[str, Tensor] = {}
    steps = sc.steps()
    for i, batch in enumerate(steps):
        # Per-layer rows are recorded eagerly only: a graph replay keeps no intermediates.
        last = i == len(steps) - 1 and not sc.graphs
        if last:
            with recording(model) as recorder:
                out = runner.prefill(batch, timer=timer)
            layers, topk = recorder.gathered()
            for name, h in layers.items():
                res[f"hidden/{name}"] = h.detach().float().cpu()
            for r, t in topk.items():
                res[f"topk/ratio{r}"] = t.detach().cpu()
        else:
            out = runner.prefill(batch, timer=timer if not sc.graphs else None)
        for rid, row in zip(batch, out.logits):
            res[f"logits/step{i}/{rid}"] = row.detach().float().cpu()
    for rid in [f"r{i}" for i in range(len(sc.lens))]:
        st = runner.alloc.requests[rid]
        slots = runner.cache.req_to_token[st.row, : st.length]
        for name, t in runner.cache.slot_view(slots).items():
            res[f"cache/{name}/{rid}"] = t.detach().float().cpu()
    return res


@dataclass
class Comparison:
    max_abs: dict[str, float]
    max_rel: dict[str, float]
    topk_equal: dict[str, bool]
    keys_missing: list[str]

    def worst(self, prefix: str) -> float:
        vals = [v for k, v in self.max_rel.items() if k.startswith(prefix)]
        return max(vals, default=0.0)

    def passed(self, tol: float) -> bool:
        return (
            not self.keys_missing
            and all(self.topk_equal.values())
            and all(v <= tol for v in self.max_rel.values())
        )


def compare(ref: dict[str, Tensor], other: dict[str, Tensor]) -> Comparison:
    missing = sorted(set(ref) ^ set(other))
    abs_d, rel_d, topk_eq = {}, {}, {}
    for k in sorted(set(ref) & set(other)):
        a, b = ref[k], other[k]
        if k.startswith("topk/"):
            topk_eq[k] = bool(torch.equal(a.sort(-1).values, b.sort(-1).values))
            continue
        diff = (a - b).abs()
        abs_d[k] = float(diff.max()) if diff.numel() else 0.0
        scale = float(a.abs().max()) if a.numel() else 0.0
        rel_d[k] = abs_d[k] / max(scale, 1e-30) if scale else abs_d[k]
    return Comparison(abs_d, rel_d, topk_eq, missing)


def summarize(cmp: Comparison, tol: float) -> dict[str, Any]:
    """Largest differences per layer, for `dsv4cp check --json`."""
    layers: dict[str, float] = {}
    for k, v in cmp.max_rel.items():
        if k.startswith("hidden/"):
            layers[k.split("/", 1)[1]] = v
    caches: dict[str, float] = {}
    for k, v in cmp.max_rel.items():
        if k.startswith("cache/"):
            name = k.split("/")[1]
            caches[name] = max(caches.get(name, 0.0), v)
    return {
        "pass": cmp.passed(tol),
        "tolerance_rel": tol,
        "logits_max_rel": cmp.worst("logits/"),
        "layers_max_rel": layers,
        "caches_max_rel": caches,
        "topk_identical": all(cmp.topk_equal.values()),
        "missing": cmp.keys_missing,
    }


def _rank_main(
    group: CPGroup, sc: Scenario, timed: bool, per_process_gpu: bool
) -> tuple[dict[str, Tensor], list[tuple[str, float, int]]] | None:
    if per_process_gpu:
        torch.cuda.set_device(group.rank % torch.cuda.device_count())
    if sc.graphs and group.rank == 0 and not logging.getLogger().handlers:
        # Show the per-bucket capture time and memory (GraphRunner logs them at INFO).
        logging.basicConfig(level=logging.INFO, format="      %(name)s: %(message)s")
    timer = StageTimer(sc.device) if timed and not sc.graphs else None
    out = run_scenario(sc, group, timer=timer)
    if group.rank != 0:
        return None
    return out, (timer.rows() if timer else [])


def run_cp_scenario(
    sc: Scenario,
    cp_size: int,
    backend: str = "gloo",
    *,
    timeout_s: float = 60.0,
    check_order: bool = True,
    timed: bool = False,
) -> tuple[dict[str, Tensor], list[tuple[str, float, int]]]:
    """Rank 0's results (and stage times) of `sc` on `cp_size` ranks.

    backend: "gloo"/"nccl" spawn one process per rank, "fake" runs the ranks as threads.
    """
    from dsv4cp.cp.launch import run_cp

    per_process_gpu = sc.device == "cuda" and backend == "nccl"
    results = run_cp(
        cp_size,
        _rank_main,
        sc,
        timed,
        per_process_gpu,
        backend=backend,
        timeout_s=timeout_s,
        check_order=check_order,
    )
    return results[0]
