"""DeepSeek-V4.1 attention configuration: parsing, validation, presets and layer roles."""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass, field
from typing import Any

from dsv4cp.ops.rope import YarnScaling

SUPPORTED_RATIOS = (0, 1, 2)


@dataclass(frozen=True)
class LayerRole:
    """What one attention layer computes and which earlier layers it reads from."""

    layer: int
    ratio: int
    kv_source: int | None  # layer whose compressed KV / index K this layer reads (itself if owner)
    owns_compressor: bool
    index_source: bool  # owns an indexer (wq_b, weights_proj) and computes its own top-k
    topk_from: int | None  # layer whose top-k this layer uses (itself if index source)
    candidate_source: bool  # publishes candidate blocks
    candidate_consumer: bool  # picks its top-k inside the published blocks

    @property
    def compressed(self) -> bool:
        return self.ratio != 0

    @property
    def name(self) -> str:
        if self.ratio == 0:
            return "swa"
        parts = [f"r{self.ratio}"]
        if self.owns_compressor:
            parts.append("kv_source")
        if self.candidate_source:
            parts.append("candidate_source")
        elif self.candidate_consumer:
            parts.append("candidate_consumer")
        elif self.index_source:
            parts.append("index_source")
        if not self.index_source:
            parts.append("reuse_topk")
        return "+".join(parts)


@dataclass(frozen=True)
class DeepseekV41Config:
    """Attention-relevant fields of a DeepSeek-V4.1 HF config (attention-math.md §1.1)."""

    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    head_dim: int
    qk_rope_head_dim: int
    q_lora_rank: int
    o_lora_rank: int
    o_groups: int
    sliding_window: int
    rms_norm_eps: float
    rope_theta: float
    compress_rope_theta: float
    rope_scaling: YarnScaling | None
    max_position_embeddings: int
    index_n_heads: int
    index_head_dim: int
    index_topk: int
    compress_ratios: tuple[int, ...]
    kv_source_layer_ids: tuple[int, ...]
    index_source_layer_ids: tuple[int, ...]
    candidate_source_layer_id: int = -1
    candidate_topk_blocks: int = 0
    candidate_block_size: int = 0
    vocab_size: int = 129280
    intermediate_size: int = 0
    num_key_value_heads: int = 1
    q_head_norm: bool = False
    model_type: str = field(default="deepseek_v41_text", compare=False)
    extra: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "compress_ratios", tuple(int(r) for r in self.compress_ratios))
        object.__setattr__(self, "kv_source_layer_ids", tuple(self.kv_source_layer_ids))
        object.__setattr__(self, "index_source_layer_ids", tuple(self.index_source_layer_ids))
        if self.intermediate_size == 0:
            object.__setattr__(self, "intermediate_size", 2 * self.hidden_size)
        self._validate()

    # ------------------------------------------------------------------ derived sizes
    @property
    def nope_dim(self) -> int:
        return self.head_dim - self.qk_rope_head_dim

    @property
    def group_dim(self) -> int:
        return self.num_attention_heads * self.head_dim // self.o_groups

    @property
    def layer_ratios(self) -> tuple[int, ...]:
        return self.compress_ratios[: self.num_hidden_layers]

    # ------------------------------------------------------------------ validation
    def _validate(self) -> None:
        def bad(name: str, msg: str) -> ValueError:
            return ValueError(f"DeepseekV41Config.{name}: {msg}")

        for name in (
            "hidden_size",
            "num_hidden_layers",
            "num_attention_heads",
            "head_dim",
            "qk_rope_head_dim",
            "q_lora_rank",
            "o_lora_rank",
            "o_groups",
            "sliding_window",
            "index_n_heads",
            "index_head_dim",
            "index_topk",
            "vocab_size",
            "max_position_embeddings",
        ):
            if int(getattr(self, name)) <= 0:
                raise bad(name, f"must be positive, got {getattr(self, name)}")
        if self.num_key_value_heads != 1:
            raise bad(
                "num_key_value_heads", f"V4.1 attention is MQA (1), got {self.num_key_value_heads}"
            )
        if self.qk_rope_head_dim % 2 or self.qk_rope_head_dim > self.head_dim:
            raise bad("qk_rope_head_dim", "must be even and at most head_dim")
        if self.qk_rope_head_dim > self.index_head_dim:
            raise bad("index_head_dim", "must be at least qk_rope_head_dim (RoPE on its tail)")
        if self.num_attention_heads % self.o_groups:
            raise bad(
                "o_groups",
                f"num_attention_heads={self.num_attention_heads} is not divisible by "
                f"o_groups={self.o_groups}",
            )
        if self.rms_norm_eps < 0:
            raise bad("rms_norm_eps", "must be non-negative")
        n = self.num_hidden_layers
        if len(self.compress_ratios) < n:
            raise bad(
                "compress_ratios",
                f"has {len(self.compress_ratios)} entries for num_hidden_layers={n}",
            )
        for i, r in enumerate(self.layer_ratios):
            if r not in SUPPORTED_RATIOS:
                raise bad(
                    "compress_ratios",
                    f"layer {i} has ratio {r}; V4.1 supports {SUPPORTED_RATIOS} "
                    "(ratios 4 and 128 are DeepSeek-V4, not V4.1)",
                )
        ratios = self.layer_ratios
        for name in ("kv_source_layer_ids", "index_source_layer_ids"):
            ids = getattr(self, name)
            if list(ids) != sorted(set(ids)):
                raise bad(name, f"must be strictly increasing, got {list(ids)}")
            for i in ids:
                if not 0 <= i < n:
                    raise bad(name, f"layer {i} is outside 0..{n - 1}")
                if ratios[i] == 0:
                    raise bad(name, f"layer {i} is not a compressed layer (ratio 0)")
        for i in self.kv_source_layer_ids:
            if i not in self.index_source_layer_ids:
                raise bad(
                    "index_source_layer_ids",
                    f"kv source layer {i} must also be an index source (it owns index K)",
                )
        for i, r in enumerate(ratios):
            if r == 0:
                continue
            if self._nearest(self.kv_source_layer_ids, i, r) is None:
                raise bad(
                    "kv_source_layer_ids",
                    f"layer {i} (ratio {r}) has no kv source of ratio {r} at or before it",
                )
            if self._nearest(self.index_source_layer_ids, i, r) is None:
                raise bad(
                    "index_source_layer_ids",
                    f"layer {i} (ratio {r}) has no index source of ratio {r} at or before it",
                )
        c = self.candidate_source_layer_id
        if c >= 0:
            if c >= n or c not in self.index_source_layer_ids:
                raise bad("candidate_source_layer_id", f"layer {c} is not an index source")
            if self.candidate_topk_blocks < 1 or self.candidate_block_size < 1:
                raise bad(
                    "candidate_topk_blocks",
                    "candidate_topk_blocks and candidate_block_size must be >= 1 "
                    "when a candidate source is set",
                )
            capacity = (self.candidate_topk_blocks - 1) * self.candidate_block_size + 1
            if capacity < self.index_topk:
                raise bad(
                    "index_topk",
                    f"index_topk={self.index_topk} is larger than the compressed candidate "
                    f"capacity (candidate_topk_blocks-1)*candidate_block_size+1={capacity}",
                )

    @staticmethod
    def _nearest_in(ids: tuple[int, ...], ratios: tuple[int, ...], i: int, r: int) -> int | None:
        best = None
        for j in ids:
            if j <= i and ratios[j] == r:
                best = j
        return best

    def _nearest(self, ids: tuple[int, ...], i: int, r: int) -> int | None:
        return self._nearest_in(ids, self.layer_ratios, i, r)

    # ------------------------------------------------------------------ layer roles
    def layer_role(self, i: int) -> LayerRole:
        if not 0 <= i < self.num_hidden_layers:
            raise IndexError(f"layer {i} outside 0..{self.num_hidden_layers - 1}")
        r = self.layer_ratios[i]
        if r == 0:
            return LayerRole(i, 0, None, False, False, None, False, False)
        kv_src = self._nearest(self.kv_source_layer_ids, i, r)
        idx_src = self._nearest(self.index_source_layer_ids, i, r)
        is_index = i in self.index_source_layer_ids
        c = self.candidate_source_layer_id
        cand_source = is_index and i == c
        cand_consumer = is_index and c >= 0 and i > c and self.layer_ratios[c] == r
        return LayerRole(
            layer=i,
            ratio=r,
            kv_source=kv_src,
            owns_compressor=i in self.kv_source_layer_ids,
            index_source=is_index,
            topk_from=idx_src,
            candidate_source=cand_source,
            candidate_consumer=cand_consumer,
        )

    def layer_roles(self) -> list[LayerRole]:
        return [self.layer_role(i) for i in range(self.num_hidden_layers)]

    def compress_rope(self, ratio: int) -> tuple[float, YarnScaling | None]:
        """(theta, yarn) of a layer's RoPE table (§3): plain for ratio 0, YaRN otherwise."""
        if ratio == 0:
            return self.rope_theta, None
        return self.compress_rope_theta, self.rope_scaling

    # ------------------------------------------------------------------ (de)serialisation
    @classmethod
    def from_hf(cls, source: str | os.PathLike[str] | dict[str, Any]) -> DeepseekV41Config:
        """Read a V4.1 config.json: a dict, a file or a directory; `text_config` nested or flat."""
        if isinstance(source, dict):
            raw = dict(source)
        else:
            path = os.fspath(source)
            if os.path.isdir(path):
                path = os.path.join(path, "config.json")
            if not os.path.isfile(path):
                raise FileNotFoundError(f"no config.json at {path}")
            with open(path) as f:
                raw = json.load(f)
        text = raw.get("text_config")
        cfg = dict(text) if isinstance(text, dict) else dict(raw)
        required = (
            "hidden_size",
            "num_hidden_layers",
            "num_attention_heads",
            "head_dim",
            "qk_rope_head_dim",
            "q_lora_rank",
            "o_lora_rank",
            "o_groups",
            "sliding_window",
            "rms_norm_eps",
            "rope_theta",
            "compress_rope_theta",
            "index_n_heads",
            "index_head_dim",
            "index_topk",
            "compress_ratios",
            "kv_source_layer_ids",
            "index_source_layer_ids",
        )
        missing = [k for k in required if k not in cfg]
        if missing:
            raise ValueError(f"DeepseekV41Config: config.json lacks required fields {missing}")
        rs = cfg.get("rope_scaling")
        yarn = None
        if rs:
            kind = rs.get("rope_type", rs.get("type"))
            if kind != "yarn":
                raise ValueError(
                    f"DeepseekV41Config.rope_scaling: only yarn is supported, got {kind}"
                )
            yarn = YarnScaling(
                factor=float(rs["factor"]),
                original_max_position=int(rs["original_max_position_embeddings"]),
                beta_fast=float(rs.get("beta_fast", 32)),
                beta_slow=float(rs.get("beta_slow", 1)),
            )
        names = {f.name for f in dataclasses.fields(cls)} - {"rope_scaling", "extra"}
        kwargs = {k: cfg[k] for k in names if k in cfg}
        for k in ("kv_source_layer_ids", "index_source_layer_ids", "compress_ratios"):
            kwargs[k] = tuple(int(v) for v in kwargs[k])
        kwargs.setdefault("max_position_embeddings", 1048576)
        extra = {k: v for k, v in cfg.items() if k not in names}
        return cls(rope_scaling=yarn, extra=extra, **kwargs)

    def to_hf(self) -> dict[str, Any]:
        text: dict[str, Any] = {}
        for f in dataclasses.fields(self):
            if f.name in ("extra", "rope_scaling"):
                continue
            v = getattr(self, f.name)
            text[f.name] = list(v) if isinstance(v, tuple) else v
        if self.rope_scaling is not None:
            y = self.rope_scaling
            text["rope_scaling"] = {
                "type": "yarn",
                "rope_type": "yarn",
                "factor": y.factor,
                "original_max_position_embeddings": y.original_max_position,
                "beta_fast": y.beta_fast,
                "beta_slow": y.beta_slow,
            }
        text["model_type"] = "deepseek_v41_text"
        return {
            "architectures": ["DeepseekV41ForCausalLM"],
            "model_type": "deepseek_v41",
            "text_config": text,
        }

    def replace(self, **changes: Any) -> DeepseekV41Config:
        return dataclasses.replace(self, **changes)

    # ------------------------------------------------------------------ presets
    @classmethod
    def tiny(cls, **overrides: Any) -> DeepseekV41Config:
        """attention-math §11.1, V4.1 variant, scaled window (W = 16): CPU tests."""
        base: dict[str, Any] = dict(
            hidden_size=128,
            num_hidden_layers=6,
            num_attention_heads=4,
            head_dim=96,
            qk_rope_head_dim=32,
            q_lora_rank=64,
            o_lora_rank=32,
            o_groups=2,
            sliding_window=16,
            rms_norm_eps=1e-20,
            rope_theta=10000.0,
            compress_rope_theta=160000.0,
            rope_scaling=YarnScaling(16.0, 65536, 32.0, 1.0),
            max_position_embeddings=1048576,
            index_n_heads=4,
            index_head_dim=64,
            index_topk=8,
            compress_ratios=(0, 2, 2, 1, 1, 1),
            kv_source_layer_ids=(1, 3),
            index_source_layer_ids=(1, 3, 5),
            candidate_source_layer_id=3,
            candidate_topk_blocks=3,
            candidate_block_size=4,
            vocab_size=512,
            intermediate_size=256,
        )
        base.update(overrides)
        return cls(**base)

    @classmethod
    def flash(cls, **overrides: Any) -> DeepseekV41Config:
        """The real DeepSeek-V4.1-Flash attention values (attention-math §1.1)."""
        base: dict[str, Any] = dict(
            hidden_size=5120,
            num_hidden_layers=40,
            num_attention_heads=64,
            head_dim=512,
            qk_rope_head_dim=64,
            q_lora_rank=1280,
            o_lora_rank=1024,
            o_groups=8,
            sliding_window=128,
            rms_norm_eps=1e-20,
            rope_theta=10000.0,
            compress_rope_theta=160000.0,
            rope_scaling=YarnScaling(16.0, 65536, 32.0, 1.0),
            max_position_embeddings=1048576,
            index_n_heads=32,
            index_head_dim=128,
            index_topk=512,
            compress_ratios=(0, 0) + (2,) * 18 + (1,) * 20 + (0, 0, 0),
            kv_source_layer_ids=(2, 8, 14, 20),
            index_source_layer_ids=(2, 8, 14, 20, 24, 28, 32, 36),
            candidate_source_layer_id=20,
            candidate_topk_blocks=2048,
            candidate_block_size=8,
            vocab_size=129280,
            intermediate_size=2 * 5120,
        )
        base.update(overrides)
        return cls(**base)
