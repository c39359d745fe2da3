"""The SGLang integration's pure parts: tokenizer, export, ForwardBatch adapter, plugin defaults.

None of these start a server; only the HF-config test needs transformers.
"""

from __future__ import annotations

import importlib.util
import json
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch

from dsv4cp.integrations.sglang import ARCHITECTURE, MODEL_TYPE
from dsv4cp.integrations.sglang.forward_batch import from_forward_batch, sync_req_to_token
from dsv4cp.tools.export_tiny import BOS, EOS, PAD, build_tokenizer, export_tiny


def test_tokenizer_covers_every_model_id() -> None:
    tok = build_tokenizer(512)
    assert tok.get_vocab_size() == 512
    assert [tok.token_to_id(s) for s in (BOS, EOS, PAD)] == [256, 257, 258]
    for i in range(512):
        tok.decode([i], skip_special_tokens=False)  # no id is unknown
    text = "Hello world, the quick brown fox! 0123 \u00e9\u00e8"
    ids = tok.encode(text, add_special_tokens=False).ids
    assert tok.decode(ids) == text
    assert max(ids) < 512 and len(ids) < len(text.encode())  # merges apply
    with pytest.raises(ValueError, match="vocab_size"):
        build_tokenizer(100)


def test_export_tiny_round_trip(tmp_path: Path) -> None:
    from dsv4cp.model import DeepseekV41Model

    path = export_tiny(tmp_path / "ckpt", seed=5)
    for name in (
        "config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
        "generation_config.json",
    ):
        assert (path / name).is_file(), name
    cfg = json.loads((path / "config.json").read_text())
    assert cfg["model_type"] == MODEL_TYPE and cfg["architectures"] == [ARCHITECTURE]
    assert cfg["eos_token_id"] == 257
    loaded = DeepseekV41Model.from_pretrained(path)
    fresh = DeepseekV41Model(loaded.config, seed=5)
    for name, t in fresh.checkpoint_weights().items():
        assert torch.equal(loaded.checkpoint_weights()[name], t), name
    again = export_tiny(tmp_path / "again", seed=5)
    assert (again / "tokenizer.json").read_bytes() == (path / "tokenizer.json").read_bytes()


# ---------------------------------------------------------------------------------- adapter
@dataclass
class _Mode:
    name: str

    def is_idle(self) -> bool:
        return self.name == "idle"

    def is_decode(self) -> bool:
        return self.name == "decode"

    def is_extend(self) -> bool:
        return self.name == "extend"

    def is_mixed(self) -> bool:
        return self.name == "mixed"

    def is_target_verify(self) -> bool:
        return self.name == "verify"

    def is_draft_extend_v2(self) -> bool:
        return False


@dataclass
class _FB:
    forward_mode: _Mode
    input_ids: torch.Tensor
    req_pool_indices: torch.Tensor
    seq_lens: torch.Tensor
    out_cache_loc: torch.Tensor
    positions: torch.Tensor
    extend_prefix_lens: torch.Tensor | None = None
    extend_seq_lens: torch.Tensor | None = None
    extend_prefix_lens_cpu: list[int] | None = None
    extend_seq_lens_cpu: list[int] | None = None
    seq_lens_cpu: torch.Tensor | None = None
    extra: dict = field(default_factory=dict)


def _extend_fb(prefix: list[int], new: list[int], rows: list[int]) -> _FB:
    pos = torch.cat([torch.arange(p, p + n) for p, n in zip(prefix, new)])
    t = int(pos.numel())
    return _FB(
        _Mode("extend"),
        torch.arange(t) % 7,
        torch.tensor(rows, dtype=torch.int32),
        torch.tensor([p + n for p, n in zip(prefix, new)]),
        torch.arange(10, 10 + t),
        pos,
        extend_prefix_lens_cpu=prefix,
        extend_seq_lens_cpu=new,
    )


def test_extend_batch_maps_requests_one_to_one() -> None:
    b = from_forward_batch(_extend_fb([0, 6], [5, 3], [4, 1]))
    assert b.mode == "extend" and b.req_rows == (4, 1)
    assert b.starts == (0, 6) and b.new_lens == (5, 3) and b.ends == (5, 9)
    pb = b.prefill_batch()
    assert [(r.req_row, r.start, len(r.token_ids)) for r in pb.requests] == [(4, 0, 5), (1, 6, 3)]
    assert b.slots.tolist() == list(range(10, 18))


def test_decode_batch_is_one_token_per_request() -> None:
    seq = torch.tensor([7, 3])
    fb = _FB(
        _Mode("decode"),
        torch.tensor([1, 2]),
        torch.tensor([0, 2]),
        seq,
        torch.tensor([40, 41]),
        seq - 1,
    )
    b = from_forward_batch(fb)
    assert b.mode == "decode" and b.starts == (6, 2) and b.new_lens == (1, 1)


def test_inconsistent_batches_raise() -> None:
    fb = _extend_fb([0, 6], [5, 3], [4, 1])
    fb.positions = fb.positions + 1
    with pytest.raises(ValueError, match="positions"):
        from_forward_batch(fb)
    fb = _extend_fb([0], [5], [0])
    fb.seq_lens = torch.tensor([6])
    with pytest.raises(ValueError, match="sequence length"):
        from_forward_batch(fb)
    fb = _extend_fb([0], [5], [0])
    fb.forward_mode = _Mode("verify")
    with pytest.raises(NotImplementedError, match="speculative"):
        from_forward_batch(fb)


def test_sync_req_to_token_copies_live_rows_only() -> None:
    src = torch.arange(40, dtype=torch.int32).view(4, 10)
    dst = torch.zeros(4, 10, dtype=torch.long)
    sync_req_to_token(dst, src, from_forward_batch(_extend_fb([2], [3], [2])))
    assert dst[2, :5].tolist() == src[2, :5].tolist()
    assert dst.sum() == src[2, :5].sum()


@pytest.mark.skipif(
    importlib.util.find_spec("transformers") is None, reason="transformers not installed"
)
def test_hf_config_flattens_and_keeps_dsv4cp_config(tmp_path: Path) -> None:
    from dsv4cp.config import DeepseekV41Config
    from dsv4cp.integrations.sglang.hf_config import POOL_HEAD_DIM, Dsv4cpConfig

    path = export_tiny(tmp_path / "ckpt", seed=0)
    raw = json.loads((path / "config.json").read_text())
    hf = Dsv4cpConfig(**{k: v for k, v in raw.items() if k != "model_type"})
    assert hf.architectures == [ARCHITECTURE] and hf.num_key_value_heads == 1
    assert (hf.hidden_size, hf.vocab_size) == (128, 512)
    # SGLang sizes its unused KV buffers with head_dim; the model's dims are in dsv4cp_config
    assert hf.head_dim == POOL_HEAD_DIM == 1
    assert not hasattr(hf, "text_config") or hf.text_config is None
    cfg = DeepseekV41Config.from_hf(hf.dsv4cp_config)
    assert cfg == DeepseekV41Config.tiny() and cfg.head_dim == 96
    # opted into SGLang's hybrid-SWA pools: one "full" layer, the rest sliding-window
    assert hf.is_hybrid_swa and hf.sliding_window == cfg.sliding_window
    assert hf.hybrid_layer_pattern == [0] + [1] * (hf.num_hidden_layers - 1)


UPSTREAM_CONFIG = (
    Path(__file__).resolve().parents[1]
    / "fixtures"
    / "dsv41-tiny-reference"
    / "checkpoint"
    / "config.json"
)


@pytest.mark.skipif(
    importlib.util.find_spec("transformers") is None, reason="transformers not installed"
)
def test_upstream_config_becomes_a_text_only_dsv4cp_config() -> None:
    """`--model-impl dsv4cp` on the released-format fixture: dsv4cp's architecture and model
    type, the untouched text config, the quantization kept out of SGLang's sight."""
    from dsv4cp.config import DeepseekV41Config
    from dsv4cp.integrations.sglang.hf_config import Dsv4cpConfig

    raw = json.loads(UPSTREAM_CONFIG.read_text())
    hf = Dsv4cpConfig.from_upstream(raw)
    assert hf.architectures == [ARCHITECTURE] and hf.model_type == MODEL_TYPE
    assert hf.dsv4cp_source_model_type == "deepseek_v41"
    assert hf.dsv4cp_quantization_config == raw["quantization_config"]
    assert getattr(hf, "quantization_config", None) is None
    assert getattr(hf, "vision_config", None) is None
    assert hf.dsv4cp_config == {k: v for k, v in raw["text_config"].items() if k != "model_type"}
    assert (hf.hidden_size, hf.num_hidden_layers, hf.vocab_size) == (128, 7, 256)
    assert (hf.bos_token_id, hf.eos_token_id) == (0, 1)
    again = Dsv4cpConfig.from_dict(hf.to_dict())  # SGLang copies configs through dicts
    assert again.dsv4cp_config == hf.dsv4cp_config
    assert again.dsv4cp_quantization_config == hf.dsv4cp_quantization_config
    assert DeepseekV41Config.from_hf(hf.dsv4cp_config).num_hidden_layers == 7
    assert (again.is_hybrid_swa, again.sliding_window, again.head_dim) == (True, 16, 1)
    assert again.hybrid_layer_pattern == [0, 1, 1, 1, 1, 1, 1]


@pytest.mark.skipif(
    importlib.util.find_spec("transformers") is None, reason="transformers not installed"
)
@pytest.mark.parametrize("text_config", ["absent", None, {}, [1, 2]])
def test_config_without_text_config_is_refused_by_name(text_config: object) -> None:
    from dsv4cp.integrations.sglang.hf_config import Dsv4cpConfig

    raw = json.loads(UPSTREAM_CONFIG.read_text())
    if text_config == "absent":
        del raw["text_config"]
    else:
        raw["text_config"] = text_config
    with pytest.raises(ValueError, match="no text_config"):
        Dsv4cpConfig.from_upstream(raw)
    raw["model_type"] = MODEL_TYPE
    with pytest.raises(ValueError, match="no text_config"):
        Dsv4cpConfig.from_dict(raw)
    Dsv4cpConfig()  # transformers' default construction (no checkpoint) still works
