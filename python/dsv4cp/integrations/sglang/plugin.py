"""The `sglang.srt.plugins` entry point: `register()`.

SGLang's `load_plugins()` calls it once per process (launcher, tokenizer manager, scheduler,
detokenizer) before server args are parsed. It only registers things, and only for dsv4cp
checkpoints (top-level `model_type` == MODEL_TYPE, architecture ARCHITECTURE):

1. the transformers config class of that model type (`AutoConfig.register`);
2. the model class: through `SGLANG_EXTERNAL_MODEL_PACKAGE` when it is free and SGLang's model
   registry is not imported yet (the registry reads it at import, also in the scheduler child,
   which inherits the environment; SGLang's own models are then loaded on first miss), else by
   inserting the class into `ModelRegistry.models` directly;
3. two hooks (`HookRegistry`, AROUND), both no-ops for other checkpoints:
   - request validation (`TokenizerManager._validate_one_request`): SGLang checks neither that
     `input_ids` lie in [0, vocab_size) nor that `text` tokenizes to at least one token; either
     reaches the model, whose error kills the scheduler and with it the server. Both become a
     ValueError, i.e. HTTP 400;
   - chat encoding: SGLang picks DeepSeek-V4.1's own chat encoder ("dsv41" recipe) for any
     architecture name containing "DeepseekV41" (`entrypoints/openai/chat_encoding.py`), which
     needs DeepSeek's special tokens at server start; a dsv4cp checkpoint whose tokenizer lacks
     them (the tiny export) falls back to its HF chat template instead.

SGLang's upstream V4.1 (`model_type` "deepseek_v41") is never touched: SGLang maps it to its own
DeepseekV4ForCausalLM. Heavy modules (torch, the model) are imported only when SGLang asks.
"""

from __future__ import annotations

import logging
import os
import sys

from dsv4cp.integrations.sglang import ARCHITECTURE, MODEL_TYPE, PACKAGE

logger = logging.getLogger(__name__)

EXTERNAL_PACKAGE_ENV = "SGLANG_EXTERNAL_MODEL_PACKAGE"

_registered = False


def register() -> None:
    """Entry point (zero-argument, idempotent)."""
    global _registered
    if _registered:
        return
    _registered = True
    _register_config()
    _register_model()
    _register_hooks()


def _register_config() -> None:
    from transformers import AutoConfig

    from dsv4cp.integrations.sglang.hf_config import Dsv4cpConfig

    AutoConfig.register(MODEL_TYPE, Dsv4cpConfig, exist_ok=True)


def _register_model() -> None:
    registry_loaded = "sglang.srt.models.registry" in sys.modules
    current = os.environ.get(EXTERNAL_PACKAGE_ENV, "")
    if not registry_loaded and current in ("", PACKAGE):
        os.environ[EXTERNAL_PACKAGE_ENV] = PACKAGE
        return
    from sglang.srt.models.registry import ModelRegistry

    from dsv4cp.integrations.sglang.model import DeepseekV41ForCausalLM

    ModelRegistry.models[ARCHITECTURE] = DeepseekV41ForCausalLM


_DEEPSEEK_BOS = "<\uff5cbegin\u2581of\u2581sentence\uff5c>"  # <｜begin▁of▁sentence｜>
_CHAT_SPEC_TARGET = "sglang.srt.entrypoints.openai.chat_encoding.resolve_chat_encoding_spec"
_VALIDATE_TARGET = "sglang.srt.managers.tokenizer_manager.TokenizerManager._validate_one_request"


def _register_hooks() -> None:
    try:
        from sglang.srt.plugins.hook_registry import HookRegistry, HookType
    except ImportError:
        return
    HookRegistry.register(_CHAT_SPEC_TARGET, chat_encoding_spec, HookType.AROUND)
    HookRegistry.register(_VALIDATE_TARGET, validate_request, HookType.AROUND)


def validate_request(
    original, manager: object, obj: object, input_ids: object, *args: object, **kwargs: object
) -> object:
    """AROUND hook: reject token ids outside the vocabulary before they reach the scheduler."""
    config = getattr(manager, "model_config", None)
    if (
        input_ids is not None
        and getattr(getattr(config, "hf_config", None), "model_type", None) == MODEL_TYPE
    ):
        if len(input_ids) == 0:  # e.g. text "": an empty extend would reach the model
            raise ValueError("the prompt has no tokens")
        vocab = int(config.vocab_size)
        bad = next((int(t) for t in input_ids if not 0 <= int(t) < vocab), None)
        if bad is not None:
            raise ValueError(f"input token id {bad} is outside the vocabulary [0, {vocab})")
    return original(manager, obj, input_ids, *args, **kwargs)


def chat_encoding_spec(original, *args: object, **kwargs: object) -> object:
    """AROUND hook: no DeepSeek chat recipe for a dsv4cp checkpoint without DeepSeek's tokens."""
    spec = original(*args, **kwargs)
    hf_config, tokenizer = kwargs.get("hf_config"), kwargs.get("tokenizer")
    if (
        spec in ("dsv4", "dsv41")
        and getattr(hf_config, "model_type", None) == MODEL_TYPE
        and not _has_token(tokenizer, _DEEPSEEK_BOS)
    ):
        return None
    return spec


def _has_token(tokenizer: object, token: str) -> bool:
    try:
        return token in tokenizer.get_vocab()
    except Exception:
        return False
