"""`dsv4cp profile`: a torch.profiler trace of a prefill, a stream-timeline PNG, overlap."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile

from dsv4cp.commands.common import (
    UsageError,
    add_size_arg,
    check_cpu_size,
    check_device,
    output_dir,
    positive_int_list,
    seed_int,
)

OUTPUTS = ("trace.json", "timeline.png", "summary.json")


def add_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = sub.add_parser("profile", help="trace a prefill of the tiny model; timeline PNG, overlap")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="where the model runs")
    p.add_argument("--lens", type=positive_int_list, default=(256, 64), help="prompt lengths")
    p.add_argument("--multistream", action="store_true", help="multistream prepare (CUDA)")
    p.add_argument("--graphs", action="store_true", help="replay a breakable CUDA graph (CUDA)")
    p.add_argument(
        "--dtype", choices=["float32", "bfloat16"], default="float32", help="model dtype"
    )
    p.add_argument("--out", default="out/profile", help="output folder")
    p.add_argument("--seed", type=seed_int, default=0, help="in [0, 2**32) (default 0)")
    add_size_arg(p)
    return p


def run(args: argparse.Namespace) -> int:
    import torch

    from dsv4cp.config import DeepseekV41Config
    from dsv4cp.graphs.runner import GraphConfig
    from dsv4cp.model import DeepseekV41Model
    from dsv4cp.observe.profiling import capture_trace
    from dsv4cp.observe.timeline import overlap_fraction, plot_timeline
    from dsv4cp.runner import PrefillRunner

    check_device(args)
    check_cpu_size(args, args.lens)
    output_dir(args.out)
    for name in OUTPUTS:
        if os.path.isdir(os.path.join(args.out, name)):
            raise UsageError(f"{os.path.join(args.out, name)}: is a directory, not a file")
    cfg = DeepseekV41Config.tiny()
    model = DeepseekV41Model(
        cfg, dtype=getattr(torch, args.dtype), device=args.device, seed=args.seed
    )
    total = sum(args.lens)
    gcfg = (
        GraphConfig(buckets=(total,), max_requests=len(args.lens), max_context=max(args.lens))
        if args.graphs
        else None
    )
    runner = PrefillRunner(
        model,
        multistream=args.multistream,
        graphs=gcfg,
        num_slots=16 * (total // 16 + len(args.lens) + 2),
        max_context=max(args.lens) + 16,
    )
    g = torch.Generator().manual_seed(args.seed)
    prompts = {
        f"r{i}": torch.randint(0, cfg.vocab_size, (n,), generator=g).tolist()
        for i, n in enumerate(args.lens)
    }

    def step() -> None:
        runner.prefill(prompts)
        for rid in prompts:
            runner.release(rid)

    print(
        f"profiling a prefill of {list(args.lens)} tokens on {args.device} "
        f"(multistream={args.multistream}, graphs={args.graphs}) ...",
        flush=True,
    )
    trace_path = os.path.join(args.out, "trace.json")
    png = os.path.join(args.out, "timeline.png")
    # The three files are written into a scratch directory inside --out and renamed into place
    # at the end: an interrupted or failed run leaves --out as it was (not a new trace beside
    # an older run's timeline and summary).
    scratch = tempfile.mkdtemp(prefix=".profile-", dir=args.out)
    try:
        trace = capture_trace(step, path=os.path.join(scratch, "trace.json"), warmup=2)
        kernels = trace.kernels() if args.device == "cuda" else []
        overlap = overlap_fraction(kernels)
        plot_timeline(
            kernels,
            os.path.join(scratch, "timeline.png"),
            highlight=("nccl",),
            title=f"prefill {list(args.lens)} tokens, tiny model, {args.device}, "
            f"multistream={args.multistream}, graphs={args.graphs}",
        )
        summary = {
            "trace": trace_path,
            "timeline": png,
            "kernels": len(kernels),
            "streams": sorted({k.stream for k in kernels}),
            "overlap_fraction": overlap,
            "prepare_nodes": sorted(
                {r.name for r in trace.ranges() if not r.name.startswith(("aten::", "cuda"))}
            )[:40],
        }
        with open(os.path.join(scratch, "summary.json"), "w") as f:
            json.dump(summary, f, indent=2)
        for name in OUTPUTS:
            os.replace(os.path.join(scratch, name), os.path.join(args.out, name))
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    print(f"trace (Perfetto / chrome://tracing): {trace_path}")
    if args.device == "cpu":  # torch's profiler may also log "gpuGetDeviceCount failed": harmless
        print(f"timeline: {png} (empty: a CPU run has no CUDA kernels)")
        print(
            "CPU run: the trace shows the schedule's node ranges on the host; the stream "
            "timeline and the overlap metric need --device cuda."
        )
        return 0
    print(f"timeline: {png}")
    print(
        f"kernels {len(kernels)} on streams {summary['streams']}; overlap (≥ 2 streams busy) "
        f"{100 * overlap:.1f}% of the GPU window"
    )
    return 0
