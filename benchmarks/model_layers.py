"""Whole V4.1 blocks at Flash dims: tokens/s, time split attention / MoE / mHC, the MoE against its
GEMM floor, and the GPU path (Triton kernels, grouped MoE) against the torch path.

Six blocks, one of each layer role (SWA; ratio-2 kv+index source; ratio-2 top-k reuse; ratio-1 kv
+ index + candidate source; ratio-1 reuse; ratio-1 candidate consumer) at the real Flash dims
(d 5120, 64 heads × 512, 32 index heads × 128, top-k 512, window 128), each with hyper-connections
(4 streams, 20 Sinkhorn rounds) and the MoE (384 fp4 experts top-6 + the fp8 shared expert,
inter 2304), random weights, bf16, one request, eager (the grouped MoE syncs the host per chunk
of 32 experts, so it is not captured). No Engram (its 189 GiB tables) and vocab 4096.

- tokens/s: median of `--iters` prefills (CUDA events), per token count (`--tokens`).
- split: one more prefill with the stage timer (syncs around each stage): `moe` → MoE, `mhc` →
  mHC, the attention's stages → attention, the rest (embedding, norms, head) → other.
- MoE floor: its GEMM FLOPs, 2·3·d·inter per token and expert (6 routed + 1 shared), at the bf16
  and fp8 tensor-core ceilings measured in the same run (8192³ `torch.mm` bf16 and
  `torch._scaled_mm` e4m3); `moe_vs_bf16_floor` = MoE time / floor time.
- equality: `--check-tokens` tokens through the GPU path (routed Triton kernels, `grouped_mm`
  experts) and the torch path (`DSV4CP_KERNELS=torch`, the experts' `loop` backend) on the same
  weights, in `--check-quant` (default none: the qat twin of 384 fp4 experts is a per-32-block
  fp64 loop, minutes at these dims): relative rms of the final hidden rows and logits, top-1
  agreement, and per block the share of tokens whose chosen experts agree. bf16 rounding flips
  a few tokens' expert choices (an O(1) change of that token's MoE output that later layers
  carry on), so `equal_up_to_bf16` is judged teacher-forced (`dsv4cp.tools.path_check`): block i
  of the GPU path fed the torch path's block i-1 output, >= 95 % of the tokens agreeing in every
  block (2 bf16 ulps in qat; in `none` within 1e-2 relative rms per token, the attention
  kernels' bf16 inputs) and the index layers' top-k matching up to ties.
- `--quant` (default qat, the released numerics) is the mode timed.

    PYTHONPATH=python python -m benchmarks.model_layers --tokens 4096,16384 \
        --out out/model_layers.json
    PYTHONPATH=python python -m benchmarks.model_layers --smoke   # CPU, tiny dims
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

from benchmarks.benchutil import Table, finish, tflops, time_cuda
from benchmarks.profile_stages import by_stage
from dsv4cp.config import DeepseekV41Config
from dsv4cp.model import DeepseekV41Model
from dsv4cp.observe.timing import StageTimer
from dsv4cp.tools.path_check import (
    compare_paths,
    record_reference,
    single_request_runner,
    torch_path,
)

ROLES = dict(
    num_hidden_layers=6,
    compress_ratios=(0, 2, 2, 1, 1, 1),
    kv_source_layer_ids=(1, 3),
    index_source_layer_ids=(1, 3, 5),
    candidate_source_layer_id=3,
    num_nextn_predict_layers=0,
    dspark_target_layer_ids=(),
    engram_layer_ids=(),
    engram_num_embeddings=(),
)


def layer_subset_config(*, blocks: bool = True, **overrides: Any) -> DeepseekV41Config:
    """Flash dims, six layers (one per role), no DSpark or Engram. `blocks`: mHC + MoE as
    released; False: one residual stream and a dense SwiGLU FFN (attention benchmarks)."""
    extra: dict[str, Any] = {} if blocks else dict(hc_mult=1, n_routed_experts=0)
    return DeepseekV41Config.flash(**{**ROLES, "vocab_size": 4096, **extra, **overrides})


def moe_gemm_flops(cfg: DeepseekV41Config, tokens: int) -> float:
    """GEMM FLOPs of every MoE layer for `tokens` tokens: k routed + 1 shared expert each."""
    per_token_expert = 2 * 3 * cfg.hidden_size * cfg.moe_intermediate_size
    experts = cfg.num_experts_per_tok + cfg.n_shared_experts
    return per_token_expert * experts * tokens * cfg.num_hidden_layers


def gemm_ceilings(n: int = 8192) -> dict[str, float]:
    """TFLOP/s of an n³ GEMM in bf16 and in fp8 e4m3 (`torch._scaled_mm`, fp32 scales)."""
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    out = {"bf16": tflops(2 * n**3, time_cuda(lambda: a @ b, warmup=3, iters=10)["median_ms"])}
    a8, b8 = a.to(torch.float8_e4m3fn), b.t().contiguous().to(torch.float8_e4m3fn).t()
    one = torch.ones((), device="cuda")
    try:
        ms = time_cuda(
            lambda: torch._scaled_mm(a8, b8, one, one, out_dtype=torch.bfloat16), warmup=3, iters=10
        )["median_ms"]
        out["fp8"] = tflops(2 * n**3, ms)
    except RuntimeError as e:  # no fp8 tensor cores on this device
        print(f"  fp8 ceiling not measured: {e}", file=sys.stderr)
    return out


def split_stages(rows: list[tuple[str, float, int]], total_ms: float) -> dict[str, float]:
    """Stage timer rows → ms of attention / moe / mhc / other (what no stage covers)."""
    out = {"attention_ms": 0.0, "moe_ms": 0.0, "mhc_ms": 0.0}
    for name, ms, _ in rows:
        key = {"moe": "moe_ms", "ffn": "moe_ms", "mhc": "mhc_ms"}.get(name, "attention_ms")
        out[key] += ms
    out["other_ms"] = max(total_ms - sum(out.values()), 0.0)
    return out


def _prefill(
    model: DeepseekV41Model, prompt: list[int], *, timer: StageTimer | None = None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    runner = single_request_runner(model, len(prompt))
    out = runner.prefill({"r": prompt}, return_all_logits=True, timer=timer)
    return out.hidden.float(), out.all_logits


@contextmanager
def recording_routes(into: list[torch.Tensor]) -> Iterator[None]:
    """Append each MoE call's chosen experts (ascending, [T, k]) to `into`, in call order."""
    from dsv4cp.ops import moe as moe_ops

    original = moe_ops.route

    def recorded(*args: Any, **kwargs: Any) -> Any:
        routing = original(*args, **kwargs)
        into.append(routing.experts.detach().clone())
        return routing

    moe_ops.route = recorded
    try:
        yield
    finally:
        moe_ops.route = original


def check_paths(model: DeepseekV41Model, tokens: int) -> dict[str, Any]:
    """The GPU path against the torch path on one prompt. The bf16 paths round differently, and
    a rounding can flip a token's expert choice (a discrete step: that token's MoE output then
    differs by O(1), and free-running later blocks carry it); so the flips are counted per
    block and reported, and the equality is judged teacher-forced (`tools.path_check`)."""
    # a fixed prompt: at nearly tied gate scores the flip count varies from prompt to prompt
    prompt = torch.randint(
        0, model.config.vocab_size, (tokens,), generator=torch.Generator().manual_seed(0)
    ).tolist()
    fast_routes: list[torch.Tensor] = []
    ref_routes: list[torch.Tensor] = []
    with torch.inference_mode():
        with recording_routes(fast_routes):
            h_fast, lg_fast = _prefill(model, prompt)
        with torch_path(model), recording_routes(ref_routes):  # the teacher-forced record too
            ref = record_reference(model, prompt)
    assert lg_fast is not None
    h_ref = ref["hidden"][0].to(h_fast.device)
    lg_ref = ref["full_logits"][0].to(lg_fast.device)

    def rms_rel(a: torch.Tensor, b: torch.Tensor) -> float:
        return float((a - b).norm() / b.norm().clamp_min(1e-30))

    dev = h_fast.device
    same_rows = [
        (a == b).all(1).to(dev)
        if a.shape == b.shape
        else torch.zeros(tokens, dtype=torch.bool, device=dev)
        for a, b in zip(fast_routes, ref_routes)
    ]
    agree = torch.ones(tokens, dtype=torch.bool, device=dev)
    given_earlier = []  # per block: of the tokens that agreed in every earlier block, the share
    for rows in same_rows:  # that agrees here (the fresh flips, not the carried ones)
        given_earlier.append(float(rows[agree].float().mean()) if agree.any() else 0.0)
        agree &= rows
    res: dict[str, Any] = {
        "check_tokens": tokens,
        "hidden_rms_rel": rms_rel(h_fast, h_ref),
        "logits_rms_rel": rms_rel(lg_fast, lg_ref),
        "logits_top1_agree": float((lg_fast.argmax(-1) == lg_ref.argmax(-1)).float().mean()),
        "moe_calls": [len(fast_routes), len(ref_routes)],
        "experts_agree_per_block": [float(r.float().mean()) for r in same_rows],
        "experts_agree_given_earlier": given_earlier,
        "tokens_agreeing_everywhere": float(agree.float().mean()),
    }
    if agree.any():
        res["hidden_rms_rel_agreeing"] = rms_rel(h_fast[agree], h_ref[agree])
        res["logits_top1_agree_agreeing"] = float(
            (lg_fast[agree].argmax(-1) == lg_ref[agree].argmax(-1)).float().mean()
        )
    # equal up to bf16: judged teacher-forced per block (reference-check's criterion), so a
    # flip costs its token in its block only; the carried figures above are reported
    tf = compare_paths(model, prompt, ref=ref)
    res["teacher_forced"] = {k: tf[k] for k in ("blocks", "topk", "logits")}
    res["equal_up_to_bf16"] = len(fast_routes) == len(ref_routes) > 0 and tf["pass"]
    return res


def measure(model: DeepseekV41Model, tokens: int, iters: int, device: str) -> dict[str, Any]:
    cfg = model.config
    prompt = torch.randint(0, cfg.vocab_size, (tokens,)).tolist()
    runner = single_request_runner(model, tokens)

    def step() -> None:
        runner.prefill({"r": prompt})
        runner.release("r")

    with torch.inference_mode():
        stats = time_cuda(step, warmup=2, iters=iters, device=device)
        timer = StageTimer(device)
        t0 = time.perf_counter()
        runner.prefill({"r": prompt}, timer=timer)
        runner.release("r")
        timed_ms = (time.perf_counter() - t0) * 1e3
    ms = stats["median_ms"]
    row: dict[str, Any] = {"tokens": tokens, "ms": ms, "tok_per_s": tokens / (ms / 1e3)}
    row.update(split_stages(timer.rows(), timed_ms))
    row["stage_timed_ms"] = timed_ms
    return row


def profile_stages(model: DeepseekV41Model, tokens: int, device: str) -> dict[str, Any]:
    """One eager prefill of `tokens` under torch.profiler: CUDA time per stage (moe, mhc, the
    attention's nodes) with its largest kernels (`profile_stages.by_stage`), printed, returned."""
    prompt = torch.randint(0, model.config.vocab_size, (tokens,)).tolist()
    runner = single_request_runner(model, tokens)
    acts = [torch.profiler.ProfilerActivity.CPU]
    if device == "cuda":
        acts.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.inference_mode():
        runner.prefill({"r": prompt})  # warm-up
        runner.release("r")
        with torch.profiler.profile(activities=acts) as prof:
            runner.prefill({"r": prompt})
            if device == "cuda":
                torch.cuda.synchronize()
        runner.release("r")
    stages = by_stage(list(prof.events()), 12)
    print(f"  profile, {tokens} tokens: CUDA time by stage (largest kernels)")
    for where, kernels in stages.items():
        print(f"    {where}: {float(kernels[0]['cuda_ms']):.2f} ms")
        for k in kernels[1:]:
            ms, name = float(k["cuda_ms"]), str(k["kernel"])[:80]
            print(f"        {ms:9.2f} ms  x{k['calls']!s:<4} {name}")
    return stages


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", default="4096,16384", help="prompt lengths")
    ap.add_argument("--iters", type=int, default=3)
    ap.add_argument("--check-tokens", type=int, default=1024, help="GPU vs torch path size")
    ap.add_argument("--quant", choices=["qat", "none"], default="qat", help="mode timed")
    ap.add_argument("--check-quant", choices=["qat", "none"], default="none")
    ap.add_argument("--smoke", action="store_true", help="CPU, tiny dims (tiny_full config)")
    ap.add_argument("--profile-tokens", type=int, default=0, help="profile one prefill (0: off)")
    ap.add_argument("--out", default="out/model_layers.json")
    args = ap.parse_args(argv)
    if args.smoke:
        quantized = DeepseekV41Config.flash().quantization  # qat needs the released storage
        device, cfg = "cpu", DeepseekV41Config.tiny_full(quantization=quantized)
        tokens = [64, 192]
        args.check_tokens = min(args.check_tokens, 48)
    else:
        if not torch.cuda.is_available():
            print("model_layers: needs a CUDA GPU (or --smoke on CPU)", file=sys.stderr)
            return 2
        device, cfg = "cuda", layer_subset_config()
        tokens = [int(v) for v in args.tokens.split(",")]
    t0 = time.perf_counter()
    model = DeepseekV41Model(cfg, dtype=torch.bfloat16, device=device, seed=None, quant=args.quant)
    model.init_random(0, device=device)
    if device == "cuda":
        model.set_moe_backend("grouped_mm")  # never a Python loop over 384 experts
    print(f"  built {cfg.num_hidden_layers} blocks in {time.perf_counter() - t0:.1f} s", flush=True)
    ceilings = gemm_ceilings() if device == "cuda" else {}
    model.set_quant(args.check_quant)
    check = {"quant": args.check_quant, **check_paths(model, args.check_tokens)}
    model.set_quant(args.quant)
    print(f"  GPU path vs torch path: {check}", flush=True)
    table = Table(
        title=f"{cfg.num_hidden_layers} V4.1 blocks (one per role), d {cfg.hidden_size}, MoE "
        f"{cfg.n_routed_experts} experts top-{cfg.num_experts_per_tok}, mHC x{cfg.hc_mult}, bf16, "
        f"quant={model.quant}, {device}"
    )
    rows = []
    for t in tokens:
        row = measure(model, t, args.iters, device)
        flops = moe_gemm_flops(cfg, t)
        row["moe_tflops"] = tflops(flops, row["moe_ms"]) if row["moe_ms"] > 0 else None
        for kind, ceiling in ceilings.items():
            floor_ms = flops / (ceiling * 1e12) * 1e3
            row[f"moe_{kind}_floor_ms"] = floor_ms
            row[f"moe_vs_{kind}_floor"] = row["moe_ms"] / floor_ms
        rows.append(row)
        table.add(row)
        print(f"  {t} tokens: {row['tok_per_s']:.0f} tok/s", flush=True)
    table.print()
    profile = profile_stages(model, args.profile_tokens, device) if args.profile_tokens else None
    return finish(
        args.out,
        {
            "benchmark": "model_layers",
            "dtype": "bfloat16",
            "quant": model.quant,
            "config": {k: getattr(cfg, k) for k in ("hidden_size", "n_routed_experts", "hc_mult")},
            "gemm_ceiling_tflops": ceilings,
            "paths": check,
            "rows": rows,
            "profile_by_stage": profile,
        },
        check["equal_up_to_bf16"],
    )


if __name__ == "__main__":
    raise SystemExit(main())
