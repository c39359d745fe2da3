"""qat runs of the fixture checkpoint's attention layers as a residual chain (CP and chunking).

Equality between runs (`mismatches`): every bf16 value and every top-k bit for bit; the fp32
ratio-2 pair state (`pair_kv`, `pair_gate`: the compressor's fp32 projection, not quantized) up
to fp32 reduction order, 1e-6 of its largest value: CPU BLAS sums an fp32 GEMM in an order that
depends on the number of rows (measured: 1.4e-7, two fp32 ulp). A row differing in that order
could in principle flip one bf16 rounding of a pooled latent; none did in these scenarios.

`run_steps(group, steps)` builds one rank's stack (all 7 layers of the tiny released-format
checkpoint, quant="qat", bf16) and runs the batches in order: each token's input is a fixed
random row of its token id, then h = h + attn(rms_norm(h)) layer by layer. It returns, per step,
every layer's h and each index source's top-k as global rows, and at the end every cache row of
every request by position. Top-level and picklable: gloo ranks run it in their own process.
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor

from dsv4cp.checkpoint import CheckpointReader
from dsv4cp.config import DeepseekV41Config
from dsv4cp.cp.group import CPGroup
from tests.model import dsv41_fixture as fx
from tests.model.attention_stack import AttentionStack, load_attention, run_chain

Steps = tuple[tuple[tuple[str, tuple[int, ...]], ...], ...]  # per step: (rid, new token ids)


@functools.lru_cache(maxsize=1)
def config() -> DeepseekV41Config:
    return DeepseekV41Config.from_hf(fx.CHECKPOINT)


def table() -> Tensor:
    g = torch.Generator().manual_seed(7)
    return torch.randn(config().vocab_size, config().hidden_size, generator=g).bfloat16()


def prompts(lens: tuple[int, ...], seed: int = 0) -> dict[str, tuple[int, ...]]:
    g = torch.Generator().manual_seed(100 + seed)
    v = config().vocab_size
    return {
        f"r{i}": tuple(torch.randint(0, v, (n,), generator=g).tolist()) for i, n in enumerate(lens)
    }


def chunked(prompt: dict[str, tuple[int, ...]], sizes: dict[str, list[int]]) -> Steps:
    """Steps sending each request's tokens in the given chunk sizes (a request absent from a
    step once its chunks run out)."""
    out, pos = [], dict.fromkeys(prompt, 0)
    for i in range(max(len(s) for s in sizes.values())):
        step = []
        for rid, toks in prompt.items():
            if i < len(sizes[rid]):
                n = sizes[rid][i]
                step.append((rid, toks[pos[rid] : pos[rid] + n]))
                pos[rid] += n
        out.append(tuple(step))
    assert all(pos[r] == len(t) for r, t in prompt.items())
    return tuple(out)


def run_steps(group: CPGroup | None, steps: Steps) -> dict[str, Tensor]:
    cfg = config()
    with CheckpointReader(fx.CHECKPOINT) as reader:  # one per rank: readers are not thread-safe
        layers = [load_attention(cfg, reader, i, quant="qat") for i in range(cfg.num_hidden_layers)]
    stack = AttentionStack(cfg, layers, cp=group)
    body = run_chain(layers, table(), cfg.rms_norm_eps)
    res: dict[str, Tensor] = {}
    rids: list[str] = []
    for i, step in enumerate(steps):
        out = stack.step(dict(step), body)
        res.update({f"step{i}/{k}": v for k, v in out.items()})
        rids += [rid for rid, _ in step if rid not in rids]
    for rid in rids:
        res.update({f"cache/{rid}/{k}": v for k, v in stack.cache_rows(rid).items()})
    return res


def by_token(res: dict[str, Tensor], steps: Steps) -> dict[str, Tensor]:
    """Each step's rows regrouped per request and concatenated over steps, so runs that cut the
    same requests into different steps compare row for row; caches as they are."""
    out: dict[str, list[Tensor]] = {}
    for i, step in enumerate(steps):
        a = 0
        for rid, toks in step:
            for key, rows in res.items():
                if key.startswith(f"step{i}/"):
                    name = f"{rid}/{key.split('/', 1)[1]}"
                    out.setdefault(name, []).append(rows[a : a + len(toks)])
            a += len(toks)
    merged = {k: torch.cat(v) for k, v in out.items()}
    merged.update({k: v for k, v in res.items() if k.startswith("cache/")})
    return merged


FP32_STATE = ("pair_kv", "pair_gate")
FP32_STATE_TOL = 1e-6


def mismatches(got: dict[str, Tensor], want: dict[str, Tensor]) -> list[str]:
    """Keys that differ (see the module doc for what "equal" means per kind); missing keys too."""
    bad = sorted(set(got) ^ set(want))
    for key in sorted(set(got) & set(want)):
        a, b = got[key], want[key]
        if key.split("/")[-1].split(".")[0] in FP32_STATE:
            if a.shape != b.shape:
                bad.append(key)
            elif b.numel() and float((a - b).abs().max()) > FP32_STATE_TOL * float(b.abs().max()):
                bad.append(key)
        elif not torch.equal(a, b):
            bad.append(key)
    return bad
