"""The "dsv4cp" model-config parser (SGLang's `register_model_config_parser` registry).

`--model-impl dsv4cp` makes every `ModelConfig` of the server parse the checkpoint's config with
this parser (plugin hook on `ModelConfig.__init__`). It reads config.json as written, before
SGLang's own V4.1 normalisation (`configs/deepseek_v41.py`, which flattens `text_config` and
renames the architecture to SGLang's DeepseekV4ForCausalLM), and returns a `Dsv4cpConfig`:
architecture ARCHITECTURE (dsv4cp's model class), model type MODEL_TYPE. SGLang's V4 rules key
on that architecture name and on `model_type == "deepseek_v41"`, so none of them applies.

Imports sglang: loaded by `plugin.register` only.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from sglang.srt.configs.model_config_parser_registry import (
    ModelConfigParserBase,
    register_model_config_parser,
)
from transformers import PretrainedConfig

from dsv4cp.integrations.sglang import MODEL_TYPE
from dsv4cp.integrations.sglang.hf_config import Dsv4cpConfig
from dsv4cp.integrations.sglang.server_args import (
    CONFIG_PARSER,
    UPSTREAM_MODEL_TYPE,
    Dsv4cpServerArgsError,
)

__all__ = ["Dsv4cpConfigParser", "read_config_dict"]


def read_config_dict(
    model: str | Path, revision: str | None = None, **kwargs: Any
) -> dict[str, Any]:
    """config.json of a local directory or a hub id, as written (no model-type handling)."""
    raw, _ = PretrainedConfig.get_config_dict(str(model), revision=revision, **kwargs)
    return raw


@register_model_config_parser(CONFIG_PARSER)
class Dsv4cpConfigParser(ModelConfigParserBase):
    def parse(
        self, model: str | Path, trust_remote_code: bool, revision: str | None = None, **kwargs: Any
    ) -> PretrainedConfig:
        del trust_remote_code
        raw = read_config_dict(model, revision, **kwargs)
        model_type = raw.get("model_type")
        if model_type == UPSTREAM_MODEL_TYPE:
            config = Dsv4cpConfig.from_upstream(raw)
        elif model_type == MODEL_TYPE:
            config = Dsv4cpConfig.from_dict(raw)
        else:
            raise Dsv4cpServerArgsError(
                f"dsv4cp: --model-impl dsv4cp serves DeepSeek-V4.1 checkpoints (model_type "
                f"{UPSTREAM_MODEL_TYPE}) and dsv4cp exports; {model} has model_type "
                f"{model_type!r}"
            )
        config._name_or_path = str(model)
        return config
