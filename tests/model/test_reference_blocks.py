"""mHC, MoE, Engram and the final collapse against DeepSeek's reference outputs, teacher-forced.

For every block of the tiny released-format checkpoint, the streams entering it
(``block{i}.in``) and the reference attention output (``block{i}.attn_out``) go through our
hyper-connections and MoE; the result must match ``block{i}.out``. Engram layers turn
``block{i-1}.out`` (the expanded embedding for block 0) into ``block{i}.in``, hash included; the
final collapse, norm and head turn ``block6.out`` into ``full_logits``.

Tolerance: the reference itself is only defined up to the fp32 summation order of its GEMMs
(kernel_cpu.py: "at most 1 bf16 ulp of the output, rarely"), so an element agrees when it is
within one bf16 ulp of the reference, a token agrees when all its 4·128 elements do, and a block
passes when >= 95% of its tokens agree (the issue's goal) and its relative rms error is below
1e-4 (one flipped ulp on one element of a token gives ~1e-5). docs/model.md has the numbers.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import NamedTuple

import pytest
import torch
from torch import Tensor

from dsv4cp.layers.engram import TABLE_NAMES, Engram
from dsv4cp.layers.hyper_connections import HyperConnection, hc_sublayer
from dsv4cp.layers.moe import MoE
from dsv4cp.ops.engram_hash import NgramHasher
from dsv4cp.ops.hyper_connections import hc_collapse, hc_expand_embedding, identity_pre
from dsv4cp.ops.norm import rms_norm
from tests.model import dsv41_fixture as fx

N_BLOCKS = 7
TOKEN_SHARE = 0.95
RMS_REL = 1e-4
PRE_ATOL = 1e-4  # pre is fp32 from bf16 streams: a 1-ulp stream flip moves it by ~4e-5


def needs_cuda(test: Callable[..., None]) -> Callable[..., None]:
    skip = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
    return pytest.mark.gpu(skip(test))


class Agreement(NamedTuple):
    token_share: float  # tokens with every element within 1 bf16 ulp
    max_abs: float
    rms_rel: float


def agreement(ours: Tensor, ref: Tensor) -> Agreement:
    """ours / ref [T, ...]; ``ours`` may be bf16, ref fp32 (bf16 values)."""
    diff = (ours.float() - ref).abs()
    ok = (diff <= fx.ulp_bf16(ref)).flatten(1).all(dim=1)
    return Agreement(ok.float().mean().item(), diff.max().item(), (diff.norm() / ref.norm()).item())


def ref(key: str) -> Tensor:
    return fx.reference()[key][0]


class BlockParts(NamedTuple):
    attn: HyperConnection
    ffn: HyperConnection
    moe: MoE
    attn_norm: Tensor
    ffn_norm: Tensor


@functools.lru_cache(maxsize=None)
def block_parts(i: int, dtype: torch.dtype, device: str = "cpu") -> BlockParts:
    cfg = fx.text_config()
    attn = HyperConnection(cfg, "attn", device="cpu")
    ffn = HyperConnection(cfg, "ffn", device="cpu")
    moe = MoE(cfg, dtype=dtype, device="cpu")
    for part, prefix in ((attn, f"layers.{i}."), (ffn, f"layers.{i}."), (moe, f"layers.{i}.ffn.")):
        fx.load_slots(part.checkpoint_slots(prefix))
    norms = [fx.tensor(f"layers.{i}.{n}_norm.weight").to(device) for n in ("attn", "ffn")]
    return BlockParts(attn.to(device), ffn.to(device), moe.to(device), *norms)


class BlockRun(NamedTuple):
    attn_in: Tensor
    out: Tensor
    next_pre: Tensor


def run_block(
    i: int, x: Tensor, pre: Tensor, *, quant: str, dtype: torch.dtype, device: str
) -> BlockRun:
    """Block i on streams x [T, 4, d] with the reference attention output (teacher forcing)."""
    parts = block_parts(i, dtype, device)
    eps = fx.text_config().rms_norm_eps
    seen: dict[str, Tensor] = {}

    def attention(collapsed: Tensor) -> Tensor:
        seen["attn_in"] = rms_norm(collapsed, parts.attn_norm, eps)
        return ref(f"block{i}.attn_out").to(device, dtype)

    def ffn(collapsed: Tensor) -> Tensor:
        return parts.moe(rms_norm(collapsed, parts.ffn_norm, eps), quant=quant)  # type: ignore[arg-type]

    streams, attn_pre = hc_sublayer(x.to(device, dtype), pre.to(device), parts.attn, attention)
    out, ffn_pre = hc_sublayer(streams, attn_pre, parts.ffn, ffn)
    return BlockRun(seen["attn_in"], out, ffn_pre)


@functools.lru_cache(maxsize=None)
def teacher_forced(i: int, quant: str = "qat", device: str = "cpu") -> BlockRun:
    dtype = torch.bfloat16 if quant == "qat" else torch.float32
    x, pre = ref(f"block{i}.in"), ref(f"block{i}.pre_mix_in")
    run = run_block(i, x, pre, quant=quant, dtype=dtype, device=device)
    return BlockRun(*(t.cpu() for t in run))


def test_first_block_collapses_with_stream_zero() -> None:
    pre = ref("block0.pre_mix_in")
    assert torch.equal(pre, identity_pre(pre[:, 0], 4))


@pytest.mark.parametrize("i", range(N_BLOCKS))
def test_attention_input_is_the_collapsed_normed_streams(i: int) -> None:
    got = agreement(teacher_forced(i).attn_in, ref(f"block{i}.attn_in"))
    assert got.token_share == 1.0, got


@pytest.mark.parametrize("i", range(N_BLOCKS - 1))
def test_ffn_pre_is_the_next_blocks_attention_pre(i: int) -> None:
    err = (teacher_forced(i).next_pre - ref(f"block{i + 1}.pre_mix_in")).abs().max().item()
    assert err <= PRE_ATOL, f"block {i}: ffn pre vs block{i + 1}.pre_mix_in max abs {err:.3g}"


@pytest.mark.parametrize("i", range(N_BLOCKS))
def test_block_output_teacher_forced(i: int) -> None:
    got = agreement(teacher_forced(i).out, ref(f"block{i}.out"))
    assert got.token_share >= TOKEN_SHARE and got.rms_rel <= RMS_REL, f"block {i}: {got}"


@needs_cuda
@pytest.mark.parametrize("i", range(N_BLOCKS))
def test_block_output_teacher_forced_cuda(i: int) -> None:
    """On CUDA the routed experts take torch._grouped_mm (fp32 sums in another order)."""
    got = agreement(teacher_forced(i, device="cuda").out, ref(f"block{i}.out"))
    assert got.token_share >= TOKEN_SHARE and got.rms_rel <= RMS_REL, f"block {i}: {got}"


def test_exact_math_mode_is_not_the_reference() -> None:
    """The tolerance has teeth: quant="none" (no fp8/fp4 activation rounding) misses it."""
    misses = 0
    for i in range(N_BLOCKS):
        got = agreement(teacher_forced(i, "none").out, ref(f"block{i}.out"))
        misses += got.token_share < TOKEN_SHARE or got.rms_rel > RMS_REL
    assert misses == N_BLOCKS


@functools.lru_cache(maxsize=1)
def hasher() -> NgramHasher:
    from tokenizers import Tokenizer

    return NgramHasher.build(fx.text_config(), Tokenizer.from_file(str(fx.TOKENIZER)))


def engram_layer(layer: int) -> Engram:
    module = Engram(fx.text_config(), layer, dtype=torch.bfloat16, device="cpu")
    fx.load_slots(module.checkpoint_slots(f"layers.{layer}.engram."))
    module.attach_table(*(fx.shard_memmap(f"layers.{layer}.engram.{n}") for n in TABLE_NAMES))
    return module


def engram_input(layer: int) -> Tensor:
    if layer == 0:
        ids = fx.reference()["input_ids"][0]
        return hc_expand_embedding(fx.tensor("embed.weight")[ids], 4)
    return ref(f"block{layer - 1}.out").bfloat16()


def hash_ids(history: Tensor | None = None) -> Tensor:
    ids = fx.reference()["input_ids"][0]
    return hasher().hash(ids, torch.tensor([0, ids.numel()]), history=history)


@pytest.mark.parametrize("layer", [0, 1])
def test_engram_gives_the_next_block_input(layer: int) -> None:
    module = engram_layer(layer)
    out = module(engram_input(layer), hash_ids()[:, module.hash_index])
    got = agreement(out, ref(f"block{layer}.in"))
    assert got.token_share >= TOKEN_SHARE and got.rms_rel <= RMS_REL, f"layer {layer}: {got}"


@needs_cuda
@pytest.mark.parametrize("layer", [0, 1])
def test_engram_cuda_reads_rows_from_the_host_memmap(layer: int) -> None:
    module = engram_layer(layer).to("cuda")  # the table stays a host memmap
    out = module(engram_input(layer).cuda(), hash_ids().cuda()[:, module.hash_index])
    assert out.is_cuda
    got = agreement(out.cpu(), ref(f"block{layer}.in"))
    assert got.token_share >= TOKEN_SHARE and got.rms_rel <= RMS_REL, f"layer {layer}: {got}"


def test_engram_history_only_reaches_three_positions() -> None:
    """A non-empty history (a chunk continuing a request) changes exactly the first N-1 tokens:
    the hash is really compared, and n-grams are N = 4 long."""
    module = engram_layer(0)
    history = torch.tensor([[5, 9, 17]])  # compressed ids of three earlier tokens
    out = module(engram_input(0), hash_ids(history)[:, 0])
    diff = (out.float() - ref("block0.in")).abs().flatten(1).amax(dim=1)
    changed = (diff > fx.ulp_bf16(ref("block0.in")).flatten(1).amax(dim=1)).nonzero().flatten()
    assert changed.tolist() == [0, 1, 2]


def test_final_collapse_norm_head_give_the_logits() -> None:
    eps = fx.text_config().rms_norm_eps
    last = teacher_forced(N_BLOCKS - 1)
    h = hc_collapse(ref(f"block{N_BLOCKS - 1}.out").bfloat16(), last.next_pre)
    logits = (
        rms_norm(h, fx.tensor("norm.weight"), eps).float() @ fx.tensor("head.weight").float().t()
    )
    want = ref("full_logits")
    rms_rel = ((logits - want).norm() / want.norm()).item()
    top1 = (logits.argmax(-1) == want.argmax(-1)).float().mean().item()
    assert rms_rel <= 1e-3 and top1 >= 60 / 61, (rms_rel, top1)
