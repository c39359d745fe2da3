"""The transformers config class of a dsv4cp checkpoint, as SGLang's processes load it.

SGLang reads a handful of flat attributes (sizes, context length, dtype, token ids) to build its
scheduler, tokenizer manager and memory pools. The dsv4cp attention config itself travels
untouched in `dsv4cp_config` (the checkpoint's `text_config`), read back by the model class with
`DeepseekV41Config.from_hf`; `rope_scaling` is kept out of the transformers fields on purpose, so
transformers' RoPE standardisation never rewrites it.
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
    "head_dim",
    "vocab_size",
    "intermediate_size",
    "max_position_embeddings",
    "rms_norm_eps",
)


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
        kwargs.pop("rope_scaling", None)
        kwargs.pop("rope_parameters", None)
        kwargs.setdefault("architectures", [ARCHITECTURE])
        # V4.1 attention is MQA: one latent KV head (SGLang sizes its unused KV pool from it).
        kwargs.setdefault("num_key_value_heads", 1)
        kwargs.setdefault("tie_word_embeddings", False)
        self.dsv4cp_config = dsv4cp
        super().__init__(**kwargs)

    def to_dict(self) -> dict[str, Any]:
        out = super().to_dict()
        out["model_type"] = MODEL_TYPE
        return out
