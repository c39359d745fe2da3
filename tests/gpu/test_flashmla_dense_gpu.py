"""The FlashMLA workspace's dense numbering on the GPU (the Triton decode and remap, the real
`sgl-flash-mla` wheel), at a Flash layer's widths: the compressed rows numbered from the batch's
row list give the same attention, bit for bit, as the rows numbered from their marks, and a
second top-k over the same cache (a consumer's) reuses the decode with the same result as a
fresh build. The CPU twin of these checks: `tests/kernels/test_flashmla_dense_rows.py`.
"""

from __future__ import annotations

import pytest
import torch

from dsv4cp.kernels import attention_workspace, flashmla
from dsv4cp.ops.workspace_rows import WorkspaceMemo
from tests.gpu.test_fast_path import FP4, FP8, _attention_inputs, _needs_flashmla

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def _listed(n: int, seed: int) -> torch.Tensor:
    g = torch.Generator(device="cuda").manual_seed(seed)
    return torch.randperm(n, device="cuda", generator=g).int()


@pytest.mark.parametrize("quant", ["none", "qat"])
def test_dense_rows_give_the_marked_attention_bit_for_bit(quant: str) -> None:
    _needs_flashmla()
    q, swa, win, comp, top, sink = _attention_inputs(seed=2)
    listed = _listed(comp.shape[0], 2)
    args = (q, swa, win, comp, top, sink, 512**-0.5, FP8, FP4, quant)
    marked = flashmla.sparse_attention_cached(*args)
    dense = flashmla.sparse_attention_cached(*args, comp_rows=listed)
    assert torch.equal(dense, marked)
    sources = attention_workspace.workspace_sources(swa, win, comp, top, FP8, FP4, None, listed)
    kv, idx = attention_workspace.build_workspace(
        sources, slice(0, q.shape[0]), 512, torch.bfloat16
    )
    assert kv.shape[0] == swa.shape[0] + listed.shape[0]  # every listed row, in list order
    both = attention_workspace.build_workspace(
        attention_workspace.workspace_sources(swa, win, comp, top, FP8, FP4, None),
        slice(0, q.shape[0]), 512, torch.bfloat16,
    )  # fmt: skip
    w = win.shape[1]
    v = top >= 0
    assert torch.equal(idx[:, w:] >= 0, v)
    assert torch.equal(kv[idx[:, w:][v].long()], both[0][both[1][:, w:][v].long()])


def test_a_second_topk_reuses_the_decode() -> None:
    _needs_flashmla()
    q, swa, win, comp, top, sink = _attention_inputs(seed=3)
    _, _, _, _, top2, _ = _attention_inputs(seed=4)  # another top-k over the same rows
    listed, memo = _listed(comp.shape[0], 3), WorkspaceMemo()
    args = (q, swa, win, comp)
    first = flashmla.sparse_attention_cached(*args, top, sink, 512**-0.5, FP8, FP4, "qat",
                                             workspace_memo=memo, comp_rows=listed)  # fmt: skip
    kv = memo.kv
    second = flashmla.sparse_attention_cached(*args, top2, sink, 512**-0.5, FP8, FP4, "qat",
                                              workspace_memo=memo, comp_rows=listed)  # fmt: skip
    assert memo.kv is kv  # the held workspace, only remapped
    fresh = flashmla.sparse_attention_cached(*args, top2, sink, 512**-0.5, FP8, FP4, "qat")
    assert torch.equal(second, fresh) and not torch.equal(second, first)
