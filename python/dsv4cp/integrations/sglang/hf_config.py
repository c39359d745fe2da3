"""The transformers config class of a dsv4cp-served model, as SGLang's processes load it.

SGLang reads a handful of flat attributes (sizes, context length, dtype, token ids) to build its
scheduler, tokenizer manager and memory pools. The dsv4cp attention config itself travels
untouched in `dsv4cp_config` (the checkpoint's `text_config`), read back by the model class with
`DeepseekV41Config.from_hf`; `rope_scaling` is kept out of the transformers fields on purpose, so
transformers' RoPE standardisation never rewrites it.

SGLang's memory pools: the config opts into SGLang's hybrid-SWA memory (`is_hybrid_swa`, read
by `ModelConfig._derive_hybrid_model`): layer 0 counts as a "full" layer, the others as
sliding-window layers of `sliding_window` tokens (the model's window), so SGLang allocates a
full slot and an SWA slot per token and its SWA radix cache frees the SWA slots of tokens
outside the window; dsv4cp keys its SWA rows on those SWA slots (docs/sglang.md, *Caches*).
SGLang's own KV buffers are never read: `head_dim` is 1 for SGLang (`POOL_HEAD_DIM`), so they
cost 2 elements per layer per slot; the model's head dims are in `dsv4cp_config`.

Two sources: a dsv4cp export (`model_type` MODEL_TYPE, through `AutoConfig`), and an upstream
DeepSeek-V4.1 `config.json` (`from_upstream`, for `--model-impl dsv4cp`). The upstream
`quantization_config` is kept as `dsv4cp_quantization_config`, out of SGLang's sight (SGLang
would otherwise build its own FP8 method for the model), and the vision tower is dropped: a
dsv4cp-served model is text-only.
"""

from __future__ import annotations

from typing import Any

from transformers import PretrainedConfig

from dsv4cp.integrations.sglang import ARCHITECTURE, MODEL_TYPE

# Flat fields SGLang reads, copied from the dsv4cp text config when present.
_FLAT = (
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "vocab_size",
    "intermediate_size",
    "max_position_embeddings",
    "rms_norm_eps",
)
# The head dim SGLang sizes its (unused) KV buffers with: one K and one V element per layer.
POOL_HEAD_DIM = 1
# Top-level upstream fields a text-only dsv4cp-served model does not expose to SGLang.
_UPSTREAM_DROPPED = ("model_type", "vision_config", "image_token_id", "quantization_config")


def check_text_config(raw: dict[str, Any], source: str) -> dict[str, Any]:
    """The `text_config` object of a config.json dict; ValueError naming `source` if absent."""
    text = raw.get("text_config")
    if not isinstance(text, dict) or not text:
        raise ValueError(
            f"{source}: config.json has no text_config object (the model's fields); "
            f"got {type(text).__name__}"
        )
    return text


class Dsv4cpConfig(PretrainedConfig):
    model_type = MODEL_TYPE

    def __init__(self, **kwargs: Any) -> None:
        text = kwargs.pop("text_config", None)
        dsv4cp = kwargs.pop("dsv4cp_config", None) or text or {}
        if not isinstance(dsv4cp, dict):
            dsv4cp = dsv4cp.to_dict()
        dsv4cp = {k: v for k, v in dsv4cp.items() if k != "model_type"}
        for k in _FLAT:
            if k in dsv4cp:
                kwargs.setdefault(k, dsv4cp[k])
        kwargs["head_dim"] = POOL_HEAD_DIM
        layers = int(kwargs.get("num_hidden_layers") or 0)
        window = dsv4cp.get("sliding_window")
        if layers >= 2 and window:
            kwargs["is_hybrid_swa"] = True
            kwargs["sliding_window"] = int(window)
            kwargs["hybrid_layer_pattern"] = [0] + [1] * (layers - 1)
        kwargs.pop("rope_scaling", None)
        kwargs.pop("rope_parameters", None)
        kwargs.setdefault("architectures", [ARCHITECTURE])
        # V4.1 attention is MQA: one latent KV head (SGLang sizes its unused KV pool from it).
        kwargs.setdefault("num_key_value_heads", 1)
        kwargs.setdefault("tie_word_embeddings", False)
        self.dsv4cp_config = dsv4cp
        self.dsv4cp_quantization_config = kwargs.pop("dsv4cp_quantization_config", None)
        self.dsv4cp_source_model_type = kwargs.pop("dsv4cp_source_model_type", MODEL_TYPE)
        super().__init__(**kwargs)

    @classmethod
    def from_dict(cls, config_dict: dict[str, Any], **kwargs: Any) -> Any:
        # Loading a checkpoint (not the no-argument construction transformers does for
        # defaults): a missing text_config is a clear error, not an AttributeError in SGLang.
        if "dsv4cp_config" not in config_dict:
            check_text_config(config_dict, f"dsv4cp checkpoint ({MODEL_TYPE})")
        return super().from_dict(config_dict, **kwargs)

    @classmethod
    def from_upstream(cls, raw: dict[str, Any]) -> Dsv4cpConfig:
        """From an upstream DeepSeek-V4.1 config.json dict (`model_type` deepseek_v41)."""
        text = check_text_config(raw, "DeepSeek-V4.1 checkpoint (deepseek_v41)")
        fields = {k: v for k, v in raw.items() if k not in _UPSTREAM_DROPPED}
        fields["text_config"] = text
        fields["architectures"] = [ARCHITECTURE]
        fields["dsv4cp_quantization_config"] = raw.get("quantization_config")
        fields["dsv4cp_source_model_type"] = raw.get("model_type")
        return cls(**fields)

    def to_dict(self) -> dict[str, Any]:
        out = super().to_dict()
        out["model_type"] = MODEL_TYPE
        return out
