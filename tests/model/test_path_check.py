"""`tools.path_check`: the torch path's record in the reference layout, and teacher-forced
comparison that confines a difference to the block that makes it."""

from __future__ import annotations

import torch

from dsv4cp.config import DeepseekV41Config
from dsv4cp.cp.group import SingleCPGroup
from dsv4cp.model import DeepseekV41Model
from dsv4cp.tools.path_check import (
    compare_paths,
    record_reference,
    token_rms_agreement,
    torch_path,
)
from dsv4cp.tools.reference_check import Criteria, teacher_forced


def _model() -> DeepseekV41Model:
    return DeepseekV41Model(DeepseekV41Config.tiny_full(), seed=3)


def _ids(n: int) -> list[int]:
    return torch.randint(0, 512, (n,), generator=torch.Generator().manual_seed(0)).tolist()


def test_record_has_the_reference_layout() -> None:
    model, ids = _model(), _ids(40)
    cfg = model.config
    with torch.inference_mode(), torch_path(model):
        ref = record_reference(model, ids)
    assert ref["input_ids"].tolist() == [ids]
    assert ref["full_logits"].shape == (1, 40, cfg.vocab_size)
    for block in model.blocks:
        i = block.layer
        assert ref[f"block{i}.out"].shape == (1, 40, cfg.hc_mult, cfg.hidden_size)
        assert ref[f"block{i}.pre_mix_in"].shape == (1, 40, cfg.hc_mult)
        has_topk = f"block{i}.topk" in ref
        assert has_topk == block.attn.role.index_source, i
        if has_topk:  # the reference's convention: entry + T, −1 none
            top = ref[f"block{i}.topk"]
            assert ((top == -1) | (top >= 40)).all()


def test_cpu_paths_agree_everywhere() -> None:
    """On CPU both paths are the torch twins (only the experts' backend differs): every block
    within 2 ulps for every token, top-k identical."""
    res = compare_paths(_model(), _ids(48))
    assert res["pass"] is True, res
    assert [b["tf_token_agree"] for b in res["blocks"]] == [1.0] * len(res["blocks"])
    assert res["topk"] and all(k["exact_share"] == 1.0 for k in res["topk"])
    assert res["logits"]["rms_rel"] <= 1e-5


def test_a_difference_stays_in_the_block_that_makes_it() -> None:
    """Teacher forcing: a perturbed FFN norm in block 2 fails block 2 only; blocks 0–1 (before it)
    and 3+ (fed block 2's recorded output) agree, the end-to-end logits do not."""
    model, ids = _model(), _ids(48)
    with torch.inference_mode():
        ref = record_reference(model, ids)
        model.blocks[2].ffn_norm.mul_(1.5)
        blocks, _ = teacher_forced(model, ref, SingleCPGroup(), 0, Criteria())
    share = {b["block"]: b["tf_token_agree"] for b in blocks}
    assert share[0] == share[1] == 1.0
    assert share[2] < 0.5
    assert all(share[i] == 1.0 for i in share if i > 2), share


def test_bf16_none_is_judged_per_token_rms() -> None:
    """none in bf16: the kernels round the attention's inputs to bf16 where the fp32 twins do
    not, so a token agrees within NONE_BF16_TOKEN_RMS relative rms, not within ulps."""
    model = DeepseekV41Model(DeepseekV41Config.tiny_full(), dtype=torch.bfloat16, seed=3)
    res = compare_paths(model, _ids(32))
    assert res["token_rule"].startswith("token_rms_rel") and res["pass"] is True
    assert all(b["token_rms_rel_max"] == 0.0 for b in res["blocks"])


def test_token_rms_agreement_counts_tokens() -> None:
    ref = torch.ones(4, 2, 8)
    ours = ref.clone()
    ours[1] *= 1.005  # 0.5 % off: within 1e-2
    ours[3, 0, 0] = 2.0  # one element off by 1: rms 1/4 of the token
    got = token_rms_agreement(ours, ref, bound=1e-2)
    assert got["tf_token_agree"] == 0.75
    assert abs(got["token_rms_rel_max"] - 0.25) < 1e-6 and got["max_abs"] == 1.0
