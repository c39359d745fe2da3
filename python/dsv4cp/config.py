"""DeepSeek-V4.1 configuration: the whole released HF config, parsed and validated.

Each field's type and range is declared once, on the field (`config_fields.ruled`); a field
without a default is required in config.json. Parts a config may leave out get defaults that
switch them off: `n_routed_experts = 0` (no MoE: the dense SwiGLU FFN of `intermediate_size`),
`hc_mult = 1` (one residual stream: no hyper-connections), `engram_layer_ids = ()` (no Engram),
`num_nextn_predict_layers = 0` (no DSpark layers), `quantization = None` (plain bf16/fp32
weights). Layer roles are in `dsv4cp.roles`, presets in `dsv4cp.config_presets`.
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import MISSING, dataclass, field
from typing import Any, Literal

from dsv4cp import config_presets
from dsv4cp.config_fields import (
    COUNT,
    FLAG,
    IDS,
    LAYER,
    NONNEG,
    POS,
    SIZE,
    THETA,
    bad_field,
    checked,
    ruled,
)
from dsv4cp.quantization_config import QuantizationConfig
from dsv4cp.roles import LayerRole, layer_roles
from dsv4cp.rope_scaling import YarnScaling

SCORING_FUNCS = ("softmax", "sigmoid", "sqrtsoftplus")  # the reference's ModelArgs.score_func
ACTIVATIONS = ("silu",)

# config.json's top-level `model_type` says what a checkpoint directory holds: a released
# DeepSeek-V4.1 checkpoint (fp8/fp4 storage with `.scale` tensors, sharded; `from_checkpoint`)
# or a dsv4cp export (the model's own storage in one file; `save_pretrained`, `export-tiny`,
# `from_pretrained`). The export's type differs from upstream's on purpose (also for SGLang:
# integrations/sglang/__init__.py).
UPSTREAM_MODEL_TYPE = "deepseek_v41"
EXPORT_MODEL_TYPE = "dsv4cp_v41"
ARCHITECTURE = "DeepseekV41ForCausalLM"
CheckpointKind = Literal["released", "export"]


def read_config_json(source: str | os.PathLike[str]) -> Any:
    """The parsed config.json of a directory (or the file itself); FileNotFoundError when there
    is none, ValueError naming the file when it is not JSON."""
    path = os.fspath(source)
    if os.path.isdir(path):
        path = os.path.join(path, "config.json")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"no config.json at {path}")
    with open(path, encoding="utf-8") as f:
        try:
            return json.load(f)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ValueError(f"{path}: not valid JSON ({e})") from None


def not_a_checkpoint_dir(path: str | os.PathLike[str]) -> str:
    """The message for a file given where a checkpoint directory is expected (its index, its
    config.json, a shard: each was read as the other kind of file and blamed for what it lacks)."""
    return (
        f"{os.fspath(path)}: not a directory; a released-format checkpoint is a directory "
        "holding config.json, model.safetensors.index.json (or model.safetensors) and the shards"
    )


def checkpoint_kind(path: str | os.PathLike[str]) -> CheckpointKind:
    """ "released" (model_type `deepseek_v41`) or "export" (`dsv4cp_v41`) for a checkpoint
    directory; ValueError naming the directory for any other config.json."""
    raw = read_config_json(path)
    model_type = raw.get("model_type") if isinstance(raw, dict) else None
    if model_type == UPSTREAM_MODEL_TYPE:
        return "released"
    if model_type == EXPORT_MODEL_TYPE:
        return "export"
    raise ValueError(
        f"{os.fspath(path)}: config.json model_type {model_type!r} is neither a released "
        f"DeepSeek-V4.1 checkpoint ({UPSTREAM_MODEL_TYPE!r}) nor a dsv4cp export "
        f"({EXPORT_MODEL_TYPE!r})"
    )


# Parsed and validated, not used by dsv4cp yet: text prefill runs no DSpark draft (MTP) layers
# and no vision tower.
UNUSED_FIELDS = (
    "num_nextn_predict_layers",
    "dspark_block_size",
    "dspark_noise_token_id",
    "dspark_target_layer_ids",
    "dspark_markov_rank",
    "dspark_n_routed_experts",
    "dspark_num_experts_per_tok",
    "image_token_id",
    "vision_config",
)

_VISION_SIZES = (
    "num_hidden_layers",
    "hidden_size",
    "num_attention_heads",
    "intermediate_size",
    "patch_size",
    "downsample_ratio",
)


@dataclass(frozen=True)
class DeepseekV41Config:
    """A DeepSeek-V4.1 HF `text_config` (attention-math.md §1.1) plus its vision and
    quantization configs; HF field names, the reference's in comments where they differ."""

    hidden_size: int = ruled(SIZE)  # dim
    num_hidden_layers: int = ruled(SIZE)  # n_layers
    num_attention_heads: int = ruled(SIZE)
    head_dim: int = ruled(SIZE)
    qk_rope_head_dim: int = ruled(SIZE)  # rope_head_dim
    q_lora_rank: int = ruled(SIZE)
    o_lora_rank: int = ruled(SIZE)
    o_groups: int = ruled(SIZE)
    sliding_window: int = ruled(SIZE)  # window_size
    rms_norm_eps: float = ruled(NONNEG)  # norm_eps
    rope_theta: float = ruled(THETA)
    compress_rope_theta: float = ruled(THETA)
    index_n_heads: int = ruled(SIZE)
    index_head_dim: int = ruled(SIZE)
    index_topk: int = ruled(SIZE)
    compress_ratios: tuple[int, ...] = ruled(IDS)  # one per layer, DSpark layers included
    kv_source_layer_ids: tuple[int, ...] = ruled(IDS)
    index_source_layer_ids: tuple[int, ...] = ruled(IDS)
    rope_scaling: YarnScaling | None = None
    max_position_embeddings: int = ruled(SIZE, 1048576)
    candidate_source_layer_id: int = ruled(LAYER, -1)
    candidate_topk_blocks: int = ruled(COUNT, 0)
    candidate_block_size: int = ruled(COUNT, 0)
    vocab_size: int = ruled(SIZE, 129280)
    intermediate_size: int = ruled(COUNT, 0)  # dense FFN (no MoE); 0 → 2 · hidden_size
    num_key_value_heads: int = ruled(SIZE, 1)
    q_head_norm: bool = ruled(FLAG, False)
    hidden_act: str = ruled(ACTIVATIONS, "silu")
    # MoE (reference: Gate / MoE in model.py)
    n_routed_experts: int = ruled(COUNT, 0)
    n_shared_experts: int = ruled(COUNT, 0)
    num_experts_per_tok: int = ruled(COUNT, 0)  # n_activated_experts
    moe_intermediate_size: int = ruled(COUNT, 0)  # moe_inter_dim
    scoring_func: str = ruled(SCORING_FUNCS, "sqrtsoftplus")  # score_func
    routed_scaling_factor: float = ruled(POS, 1.0)  # route_scale
    swiglu_limit: float = ruled(NONNEG, 0.0)  # 0: no clamp
    norm_topk_prob: bool = ruled(FLAG, True)
    gate_temp: float = ruled(POS, 1.0)
    # hyper-connections
    hc_mult: int = ruled(SIZE, 1)
    hc_sinkhorn_iters: int = ruled(SIZE, 20)
    hc_eps: float = ruled(NONNEG, 1e-6)
    # Engram (reference: engram.py)
    engram_layer_ids: tuple[int, ...] = ruled(IDS, ())
    engram_num_embeddings: tuple[int, ...] = ruled(IDS, ())  # table rows, one per Engram layer
    engram_max_ngram_size: int = ruled(COUNT, 0)
    engram_vocab_size: int = ruled(COUNT, 0)
    engram_n_heads: int = ruled(COUNT, 0)
    engram_head_dim: int = ruled(COUNT, 0)
    engram_pad_token_id: int = ruled(COUNT, 2)  # engram_pad_id
    engram_compressed_vocab_size: int = ruled(COUNT, 0)
    # DSpark draft layers (UNUSED_FIELDS)
    num_nextn_predict_layers: int = ruled(COUNT, 0)  # n_mtp_layers
    dspark_block_size: int = ruled(COUNT, 0)
    dspark_noise_token_id: int = ruled(COUNT, 0)
    dspark_target_layer_ids: tuple[int, ...] = ruled(IDS, ())
    dspark_markov_rank: int = ruled(COUNT, 0)
    dspark_n_routed_experts: int = ruled(COUNT, 0)
    dspark_num_experts_per_tok: int = ruled(COUNT, 0)  # dspark_n_activated_experts
    image_token_id: int | None = ruled(COUNT, None)  # marks image spans (UNUSED_FIELDS)
    vision_config: dict[str, Any] | None = field(default=None, hash=False)  # UNUSED_FIELDS
    quantization: QuantizationConfig | None = None  # HF `quantization_config`
    model_type: str = field(default="deepseek_v41_text", compare=False)
    extra: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)
    roles: tuple[LayerRole, ...] = field(init=False, compare=False, repr=False)

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name, None)
            if "rule" in f.metadata and not (value is None and f.default is None):
                object.__setattr__(self, f.name, checked(f.name, value, f.metadata["rule"]))
        if self.intermediate_size == 0:
            object.__setattr__(self, "intermediate_size", 2 * self.hidden_size)
        self._validate()

    @property
    def layer_ratios(self) -> tuple[int, ...]:
        return self.compress_ratios[: self.num_hidden_layers]

    # ------------------------------------------------------------------ validation
    def _validate(self) -> None:
        if self.num_key_value_heads != 1:
            raise bad_field(
                "num_key_value_heads", f"V4.1 attention is MQA (1), got {self.num_key_value_heads}"
            )
        if self.qk_rope_head_dim % 2 or self.qk_rope_head_dim > self.head_dim:
            raise bad_field("qk_rope_head_dim", "must be even and at most head_dim")
        if self.qk_rope_head_dim > self.index_head_dim:
            raise bad_field("index_head_dim", "must be >= qk_rope_head_dim (RoPE on its tail)")
        if self.num_attention_heads % self.o_groups:
            raise bad_field(
                "o_groups",
                f"num_attention_heads={self.num_attention_heads} is not "
                f"divisible by o_groups={self.o_groups}",
            )
        n = self.num_hidden_layers
        if len(self.compress_ratios) < n + self.num_nextn_predict_layers:
            raise bad_field(
                "compress_ratios",
                f"has {len(self.compress_ratios)} entries for "
                f"num_hidden_layers={n} + num_nextn_predict_layers="
                f"{self.num_nextn_predict_layers}",
            )
        try:
            roles = layer_roles(
                self.layer_ratios,
                self.kv_source_layer_ids,
                self.index_source_layer_ids,
                self.candidate_source_layer_id,
            )
        except ValueError as e:
            raise ValueError(f"DeepseekV41Config.{e}") from None
        object.__setattr__(self, "roles", roles)
        self._check_candidates()
        self._check_moe()
        self._check_engram()
        self._check_layer_ids("dspark_target_layer_ids")
        if self.dspark_num_experts_per_tok > self.dspark_n_routed_experts:
            raise bad_field("dspark_num_experts_per_tok", "must be at most dspark_n_routed_experts")
        self._check_vision()

    def _check_candidates(self) -> None:
        if self.index_topk > self.max_position_embeddings:  # more than a context has entries
            raise bad_field(
                "index_topk",
                f"index_topk={self.index_topk} is larger than max_position_embeddings="
                f"{self.max_position_embeddings}",
            )
        if self.candidate_source_layer_id < 0:
            return
        if self.candidate_topk_blocks < 1 or self.candidate_block_size < 1:
            raise bad_field(
                "candidate_topk_blocks",
                "candidate_topk_blocks and "
                "candidate_block_size must be >= 1 when a candidate source is set",
            )
        capacity = (self.candidate_topk_blocks - 1) * self.candidate_block_size + 1
        if capacity < self.index_topk:
            raise bad_field(
                "index_topk",
                f"index_topk={self.index_topk} is larger than the "
                "compressed candidate capacity (candidate_topk_blocks-1)*"
                f"candidate_block_size+1={capacity}",
            )

    def _check_moe(self) -> None:
        if self.n_routed_experts == 0:
            return
        if not 1 <= self.num_experts_per_tok <= self.n_routed_experts:
            raise bad_field(
                "num_experts_per_tok",
                f"must be in [1, n_routed_experts="
                f"{self.n_routed_experts}], got {self.num_experts_per_tok}",
            )
        if self.moe_intermediate_size < 1:
            raise bad_field("moe_intermediate_size", "must be positive when n_routed_experts > 0")

    def _check_layer_ids(self, name: str) -> None:
        ids = getattr(self, name)
        if list(ids) != sorted(set(ids)) or any(i >= self.num_hidden_layers for i in ids):
            raise bad_field(
                name,
                f"must be strictly increasing layer ids in 0.."
                f"{self.num_hidden_layers - 1}, got {list(ids)}",
            )

    def _check_engram(self) -> None:
        self._check_layer_ids("engram_layer_ids")
        ids, tables = self.engram_layer_ids, self.engram_num_embeddings
        if not ids and not tables:
            return
        if len(tables) != len(ids) or 0 in tables:
            raise bad_field(
                "engram_num_embeddings",
                f"must hold one positive table size per layer "
                f"of engram_layer_ids {list(ids)}, got {list(tables)}",
            )
        for name in (
            "engram_vocab_size",
            "engram_n_heads",
            "engram_head_dim",
            "engram_compressed_vocab_size",
        ):
            if getattr(self, name) < 1:
                raise bad_field(name, "must be positive when engram_layer_ids is set")
        if self.engram_max_ngram_size < 2:
            raise bad_field("engram_max_ngram_size", "must be at least 2 when Engram is used")

    def _check_vision(self) -> None:
        v = self.vision_config
        if v is None:
            return
        if not isinstance(v, dict):
            raise bad_field("vision_config", f"must be a dict, got {type(v).__name__}")
        for key in _VISION_SIZES:
            if key in v:
                checked(f"vision_config.{key}", v[key], SIZE)
        if "rope_theta" in v:
            checked("vision_config.rope_theta", v["rope_theta"], POS)

    # ------------------------------------------------------------------ layer roles
    def layer_role(self, i: int) -> LayerRole:
        if not 0 <= i < self.num_hidden_layers:
            raise IndexError(f"layer {i} outside 0..{self.num_hidden_layers - 1}")
        return self.roles[i]

    def layer_roles(self) -> list[LayerRole]:
        return list(self.roles)

    def compress_rope(self, ratio: int) -> tuple[float, YarnScaling | None]:
        """(theta, yarn) of a layer's RoPE table (§3): plain for ratio 0, YaRN otherwise."""
        if ratio == 0:
            return self.rope_theta, None
        return self.compress_rope_theta, self.rope_scaling

    # ------------------------------------------------------------------ (de)serialisation
    @classmethod
    def from_hf(cls, source: str | os.PathLike[str] | dict[str, Any]) -> DeepseekV41Config:
        """Read a V4.1 config.json: a dict, a file or a directory; `text_config` nested or flat.
        Unknown `text_config` keys are kept in `extra` (and written back by `to_hf`)."""
        raw = dict(source) if isinstance(source, dict) else read_config_json(source)
        if not isinstance(raw, dict):
            raise ValueError(
                f"DeepseekV41Config: config.json must hold a JSON object, got {type(raw).__name__}"
            )
        text = raw.get("text_config")
        cfg = dict(text) if isinstance(text, dict) else dict(raw)
        fields = [f for f in dataclasses.fields(cls) if "rule" in f.metadata]
        missing = [f.name for f in fields if f.default is MISSING and f.name not in cfg]
        if missing:
            raise ValueError(f"DeepseekV41Config: config.json lacks required fields {missing}")
        names = {f.name for f in fields} | {"model_type"}
        hf_keys = {"rope_scaling", "quantization_config", "vision_config", "text_config"}
        return cls(
            rope_scaling=YarnScaling.from_hf(cfg.get("rope_scaling")),
            quantization=QuantizationConfig.from_hf(raw.get("quantization_config")),
            vision_config=raw.get("vision_config"),
            extra={k: v for k, v in cfg.items() if k not in names | hf_keys},
            **{k: cfg[k] for k in names if k in cfg},
        )

    def to_hf(self) -> dict[str, Any]:
        text: dict[str, Any] = dict(self.extra)
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if "rule" in f.metadata and v is not None:
                text[f.name] = list(v) if isinstance(v, tuple) else v
        if self.rope_scaling is not None:
            text["rope_scaling"] = self.rope_scaling.to_hf()
        text["model_type"] = "deepseek_v41_text"
        out: dict[str, Any] = {
            "architectures": [ARCHITECTURE],
            "model_type": UPSTREAM_MODEL_TYPE,
            "text_config": text,
        }
        if self.quantization is not None:
            out["quantization_config"] = self.quantization.to_hf()
        if self.vision_config is not None:
            out["vision_config"] = dict(self.vision_config)
        return out

    # ------------------------------------------------------------------ presets
    @classmethod
    def tiny(cls, **overrides: Any) -> DeepseekV41Config:
        """attention-math §11.1, V4.1 variant, scaled window (W = 16): CPU tests. No MoE,
        hyper-connections or Engram: the dense decoder dsv4cp's tests run."""
        return cls(**{**config_presets.V41_SHARED, **config_presets.TINY, **overrides})

    @classmethod
    def tiny_full(cls, **overrides: Any) -> DeepseekV41Config:
        """`tiny()` with the whole V4.1 block around the attention: hyper-connections (4
        streams) and a small MoE (8 experts top-2 + 1 shared); no Engram. `dsv4cp check`/`demo`
        run it so that CP = N vs CP = 1 covers the row-local parts too."""
        return cls.tiny(**{**config_presets.TINY_BLOCKS, **overrides})

    @classmethod
    def flash(cls, **overrides: Any) -> DeepseekV41Config:
        """The real DeepSeek-V4.1-Flash values (attention-math §1.1; the MoE, hyper-connection,
        Engram, DSpark and vision values of the reference's inference/config.json)."""
        return cls(**{**config_presets.V41_SHARED, **config_presets.FLASH, **overrides})
