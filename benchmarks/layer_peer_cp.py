"""The CP rows of `benchmarks/layer_peer.py`: rank 0 of CP = n alone on one GPU (`SoloCPGroup`:
its gathers tile its shard; compute only) against (CP 1 time) / n, over `--cp-repeats` repeats,
and the executor the `auto` multistream policy runs for each role at the rank's rows."""

from __future__ import annotations

import statistics
import traceback
from typing import Any, Protocol

import torch

from benchmarks.layer_peer_setup import Budget, error_text, release_memory
from benchmarks.prefill import SoloCPGroup
from dsv4cp.config import DeepseekV41Config
from dsv4cp.context import ForwardContext
from dsv4cp.executors import ExecutorFactory, MultistreamExecutor, StreamPool
from dsv4cp.layers.attention import DeepseekV41Attention
from dsv4cp.policy import MultistreamPolicy
from dsv4cp.roles import LayerRole


class CPRun(Protocol):
    """What the CP rows use of `layer_peer.Run`."""

    cfg: DeepseekV41Config
    device: str
    dtype: torch.dtype
    layer_ids: tuple[int, ...]
    layers: dict[int, DeepseekV41Attention]
    cp_repeats: int
    budget: Budget
    streams: StreamPool | None

    def times_between_forwards(
        self, layer: DeepseekV41Attention, x: torch.Tensor, ctx: ForwardContext
    ) -> dict[str, float]: ...


def cp_rank_rows(
    run: CPRun,
    case: str,
    ctx1: ForwardContext,
    x1: torch.Tensor,
    n: int,
    cp1: dict[int, float],
    out: list[dict[str, Any]],
) -> None:
    """Rank 0 of CP = n alone (its gathers tile its shard): compute only, one GPU, against
    (CP 1 time) / n. One layer's CP 1 graph time varied by up to 8 % between samples minutes
    apart on the H200 (docs/performance.md §14), as much as the targets' margins, so each
    repeat (`--cp-repeats`) first runs a CP 1 pass of its own, then the ranks; the CP 1 time
    is the mean of the first pass's sample and the repeats' (`cp1_samples_ms`), the rank
    time the median of the repeats' (`rank_samples_ms`), and each repeat's ratio (its rank
    over the mean of the first pass's and its own CP 1 sample) is kept with their min and
    max. The CP 1 passes run the layers in model order on the CP 1 context, so each layer
    reads what the CP 1 forwards of the layers before it wrote (the rank context shares the
    cache: a CP 1 sample taken between rank forwards would read the ranks' rows)."""
    try:
        ctx = ForwardContext.for_rank(ctx1.meta, ctx1.cache, SoloCPGroup(n))
        x = torch.randn(ctx.local_rows, run.cfg.hidden_size, device=run.device, dtype=run.dtype)
    except Exception as exc:
        traceback.print_exc()
        out.append(dict(case=case, cp=n, error=error_text(exc)))
        return
    # per layer and repeat: (its CP 1 sample, rank ms, rank / its ideal, executors' ms)
    samples: dict[int, list[tuple[float, float, float, dict[str, float]]]] = {}
    errors: dict[int, str] = {}
    for rep in range(run.cp_repeats):
        now_ms: dict[int, float] = {}
        for i in run.layer_ids:  # this repeat's CP 1 pass
            if i in cp1 and i not in errors and run.budget.left() > 0:
                try:
                    now_ms[i] = min(run.times_between_forwards(run.layers[i], x1, ctx1).values())
                except Exception as exc:
                    traceback.print_exc()
                    errors[i] = error_text(exc)
                    release_memory(run.device)
        for i in run.layer_ids:
            if i not in now_ms or run.budget.left() <= 0:
                continue
            try:
                times = run.times_between_forwards(run.layers[i], x, ctx)
            except Exception as exc:
                traceback.print_exc()
                errors[i] = error_text(exc)
                release_memory(run.device)
                continue
            best, now = min(times.values()), now_ms[i]
            ratio = best / ((now + cp1[i]) / 2 / n)  # over the first pass's and its sample
            samples.setdefault(i, []).append((now, best, ratio, times))
            print(
                f"    CP {n} layer {i} (repeat {rep + 1}): {best:.3f} ms = "
                f"{ratio:.3f}x ideal (CP 1 {cp1[i]:.3f} / "
                f"{now:.3f} ms; {', '.join(f'{k} {v:.3f}' for k, v in times.items())})",
                flush=True,
            )
    for i in run.layer_ids:
        layer = run.layers[i]
        row: dict[str, Any] = dict(case=case, cp=n, layer=i, role=layer.role.name)
        if i not in samples:
            row["error"] = errors.get(i) or ("no CP 1 time" if i not in cp1 else "time budget")
            out.append(row)
            continue
        got = samples[i]
        cp1_all = [cp1[i]] + [s[0] for s in got]
        ranks = [s[1] for s in got]
        mean = statistics.fmean(cp1_all)
        rank = statistics.median(ranks)
        per_repeat = [s[2] for s in got]
        last = got[-1][3]
        row.update(rank_ms=rank, cp1_ms=mean, ideal_ms=mean / n)
        row["rank_over_ideal"] = rank / row["ideal_ms"]
        row["rank_over_ideal_min"], row["rank_over_ideal_max"] = (
            min(per_repeat),
            max(per_repeat),
        )
        row["rank_over_ideal_repeats"] = per_repeat
        row["cp1_samples_ms"], row["rank_samples_ms"] = cp1_all, ranks
        row["rank_executor"] = min(last, key=lambda k: last[k])
        row["rank_ms_by_executor"] = [s[3] for s in got]
        auto = auto_executor(layer.role, ctx.local_rows, run.streams)
        if auto in last:
            row["auto_executor"] = auto
            row["auto_rank_ms"] = statistics.median(s[3][auto] for s in got)
            row["auto_rank_over_ideal"] = row["auto_rank_ms"] / row["ideal_ms"]
        row["replicated"] = _replicated(layer)
        print(
            f"    CP {n} layer {i}: {rank:.3f} ms = {row['rank_over_ideal']:.3f}x ideal "
            f"({len(got)} repeat(s): {row['rank_over_ideal_min']:.3f}–"
            f"{row['rank_over_ideal_max']:.3f}x)",
            flush=True,
        )
        out.append(row)


def auto_executor(role: LayerRole, local_rows: int, streams: StreamPool | None) -> str:
    """The executor ("serial" / "multistream") the `auto` policy (with $DSV4CP_MULTISTREAM*)
    runs for `role` at `local_rows` rows inside CUDA graphs: `ExecutorFactory.choose`'s pick
    (no streams, as on the CPU: serial)."""
    factory = ExecutorFactory(MultistreamPolicy.from_env("auto"), streams)
    chosen = factory.choose(local_rows, graphs=True).for_role(role)
    return "multistream" if isinstance(chosen, MultistreamExecutor) else "serial"


def _replicated(layer: DeepseekV41Attention) -> str:
    parts = ["SWA store of all T rows"]
    if layer.role.owns_compressor:
        parts.append("compressor + index keys of all T rows, index-K workspace of the context")
    if layer.role.index_source:
        parts.append("(indexer: local queries x whole context, not replicated)")
    return "; ".join(parts)
