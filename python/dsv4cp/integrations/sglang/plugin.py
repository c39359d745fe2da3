"""The `sglang.srt.plugins` entry point: `register()`.

SGLang's `load_plugins()` calls it once per process (launcher, tokenizer manager, scheduler,
detokenizer) before server args are parsed. It registers, and changes nothing for a model
dsv4cp does not serve (server_args.served_by_dsv4cp: a dsv4cp export, or a DeepSeek-V4.1
checkpoint launched with `--model-impl dsv4cp`):

1. the transformers config class of a dsv4cp export (`AutoConfig.register`) and the "dsv4cp"
   model-config parser (config_parser.py);
2. the model class: through `SGLANG_EXTERNAL_MODEL_PACKAGE` when it is free and SGLang's model
   registry is not imported yet (the registry reads it at import, also in the scheduler child,
   which inherits the environment; SGLang's own models are then loaded on first miss), else by
   inserting the class into `ModelRegistry.models` directly;
3. a model-override provider for ARCHITECTURE (SGLang's `register_model_override`): during
   server-arg resolution it refuses flags that do not apply (server_args.check_server_args) and
   declares the values the model needs (server_args.resolution_declarations);
4. hooks (`HookRegistry`, AROUND):
   - `prepare_server_args` (the CLI): the same flag check right after parsing, reported as one
     `sglang serve: error: dsv4cp: ...` line and exit code 2, like argparse, instead of a
     traceback from inside SGLang's resolution;
   - `ModelConfig.__init__`: `--model-impl dsv4cp` selects the "dsv4cp" config parser;
   - request validation (`TokenizerManager._validate_one_request` per item, `_init_req_state`
     for the request ids; the OpenAI chat and detokenize handlers' `_validate_request`):
     request_validation.py;
   - chat encoding: SGLang picks DeepSeek-V4.1's own chat encoder ("dsv41" recipe) for any
     architecture name containing "DeepseekV41" (`entrypoints/openai/chat_encoding.py`), which
     needs DeepSeek's special tokens at server start; a checkpoint whose tokenizer lacks them
     (the tiny export, the released-format tiny fixture) falls back to its HF chat template instead.

Heavy modules (torch, the model) are imported only when SGLang asks.
"""

from __future__ import annotations

import inspect
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
    _register_override_provider()
    _register_hooks()


def _register_config() -> None:
    from transformers import AutoConfig

    import dsv4cp.integrations.sglang.config_parser  # noqa: F401  (registers the parser)
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


def _register_override_provider() -> None:
    from sglang.srt.arg_groups.model_override_base import register_model_override

    register_model_override(ARCHITECTURE)(resolution_overrides)


def resolution_overrides(server_args: object, hf_config: object) -> dict:
    """Model-override provider: check the flags of a dsv4cp-served model, declare its values."""
    from dsv4cp.integrations.sglang.server_args import (
        check_server_args,
        resolution_declarations,
        served_by_dsv4cp,
    )

    source = getattr(hf_config, "dsv4cp_source_model_type", MODEL_TYPE)
    if not served_by_dsv4cp(source, server_args):
        return {}
    check_server_args(server_args)
    return resolution_declarations(server_args)


# What DeepSeek's chat recipe encodes with: its special tokens, as added tokens of the tokenizer.
_DEEPSEEK_CHAT_TOKENS = (
    "<\uff5cbegin\u2581of\u2581sentence\uff5c>",  # <｜begin▁of▁sentence｜>
    "<\uff5cSystem\uff5c>",
    "<\uff5cUser\uff5c>",
    "<\uff5cAssistant\uff5c>",
)
_CHAT_SPEC_TARGET = "sglang.srt.entrypoints.openai.chat_encoding.resolve_chat_encoding_spec"
_TOKENIZER_MANAGER = "sglang.srt.managers.tokenizer_manager.TokenizerManager"
_VALIDATE_TARGET = f"{_TOKENIZER_MANAGER}._validate_one_request"
_REQ_STATE_TARGET = f"{_TOKENIZER_MANAGER}._init_req_state"
_OPENAI = "sglang.srt.entrypoints.openai"
_CHAT_VALIDATE_TARGET = f"{_OPENAI}.serving_chat.OpenAIServingChat._validate_request"
_DETOKENIZE_VALIDATE_TARGET = (
    f"{_OPENAI}.serving_tokenize.OpenAIServingDetokenize._validate_request"
)
_MODEL_CONFIG_TARGET = "sglang.srt.configs.model_config.ModelConfig.__init__"
_PREPARE_TARGET = "sglang.srt.server_args.prepare_server_args"


def _register_hooks() -> None:
    try:
        from sglang.srt.plugins.hook_registry import HookRegistry, HookType
    except ImportError:
        return
    HookRegistry.register(_CHAT_SPEC_TARGET, chat_encoding_spec, HookType.AROUND)
    HookRegistry.register(_VALIDATE_TARGET, validate_request, HookType.AROUND)
    HookRegistry.register(_REQ_STATE_TARGET, validate_request_ids, HookType.AROUND)
    HookRegistry.register(_CHAT_VALIDATE_TARGET, validate_chat_request, HookType.AROUND)
    HookRegistry.register(_DETOKENIZE_VALIDATE_TARGET, validate_detokenize_request, HookType.AROUND)
    HookRegistry.register(_MODEL_CONFIG_TARGET, model_config_init, HookType.AROUND)
    HookRegistry.register(_PREPARE_TARGET, prepare_server_args, HookType.AROUND)


def prepare_server_args(original, argv: list[str], *args: object, **kwargs: object) -> object:
    """AROUND hook: SGLang's CLI parsing, then dsv4cp's flag check; a refusal exits with 2."""
    from dsv4cp.integrations.sglang.server_args import Dsv4cpServerArgsError

    server_args = original(argv, *args, **kwargs)
    try:
        check_launch(server_args)
    except Dsv4cpServerArgsError as e:
        print(f"sglang serve: error: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    return server_args


def check_launch(server_args: object) -> None:
    """Raise Dsv4cpServerArgsError when dsv4cp serves this model and a flag does not apply."""
    from dsv4cp.integrations.sglang.config_parser import read_config_dict
    from dsv4cp.integrations.sglang.hf_config import check_text_config
    from dsv4cp.integrations.sglang.server_args import (
        Dsv4cpServerArgsError,
        check_server_args,
        served_by_dsv4cp,
    )

    path = getattr(server_args, "model_path", None)
    if not path or str(path).lower() in ("none", "dummy"):
        return
    try:
        raw = read_config_dict(path, getattr(server_args, "revision", None))
    except Exception:  # SGLang reports an unreadable config itself, with its own message
        return
    model_type = raw.get("model_type")
    if served_by_dsv4cp(model_type, server_args):
        try:
            check_text_config(raw, str(path))
        except ValueError as e:
            raise Dsv4cpServerArgsError(f"dsv4cp: {e}") from None
        check_server_args(server_args)


def model_config_init(original, self: object, *args: object, **kwargs: object) -> None:
    """AROUND hook: `--model-impl dsv4cp` parses config.json with the "dsv4cp" parser."""
    from dsv4cp.integrations.sglang.server_args import CONFIG_PARSER, dsv4cp_requested

    bound = inspect.signature(original).bind(self, *args, **kwargs)
    params = bound.arguments
    impl = params.get("model_impl", "auto")
    parser = params.get("model_config_parser", "auto")
    if dsv4cp_requested(impl, parser) and parser == "auto":
        params["model_config_parser"] = CONFIG_PARSER
    return original(*bound.args, **bound.kwargs)


def _serves_dsv4cp(manager: object) -> bool:
    config = getattr(manager, "model_config", None)
    return getattr(getattr(config, "hf_config", None), "model_type", None) == MODEL_TYPE


def validate_request(
    original, manager: object, obj: object, input_ids: object, *args: object, **kwargs: object
) -> object:
    """AROUND hook: dsv4cp's checks of one request item (request_validation.py), then SGLang's."""
    if _serves_dsv4cp(manager):
        from dsv4cp.integrations.sglang.request_validation import validate_generate_request

        vocab = int(manager.model_config.vocab_size)
        validate_generate_request(obj, input_ids, vocab_size=vocab)
    return original(manager, obj, input_ids, *args, **kwargs)


def validate_request_ids(
    original, manager: object, obj: object, *args: object, **kwargs: object
) -> object:
    """AROUND hook: request ids checked before SGLang files the request under them."""
    if _serves_dsv4cp(manager):
        from dsv4cp.integrations.sglang.request_validation import validate_request_ids as check

        check(obj)
    return original(manager, obj, *args, **kwargs)


def validate_chat_request(original, handler: object, request: object) -> str | None:
    """AROUND hook: SGLang's checks of an OpenAI chat request, then dsv4cp's (an error string
    becomes HTTP 400)."""
    error = original(handler, request)
    if error or not _serves_dsv4cp(getattr(handler, "tokenizer_manager", None)):
        return error
    from dsv4cp.integrations.sglang.request_validation import chat_request_error

    return chat_request_error(request)


def validate_detokenize_request(original, handler: object, request: object) -> str | None:
    """AROUND hook: `/v1/detokenize` token ids checked against the vocabulary."""
    error = original(handler, request)
    manager = getattr(handler, "tokenizer_manager", None)
    if error or not _serves_dsv4cp(manager):
        return error
    from dsv4cp.integrations.sglang.request_validation import detokenize_request_error

    vocab = int(manager.model_config.vocab_size)  # type: ignore[union-attr]
    return detokenize_request_error(getattr(request, "tokens", None), vocab)


def chat_encoding_spec(original, *args: object, **kwargs: object) -> object:
    """AROUND hook: no DeepSeek chat recipe for a dsv4cp checkpoint without DeepSeek's tokens."""
    spec = original(*args, **kwargs)
    hf_config, tokenizer = kwargs.get("hf_config"), kwargs.get("tokenizer")
    if (
        spec in ("dsv4", "dsv41")
        and getattr(hf_config, "model_type", None) == MODEL_TYPE
        and not _has_tokens(tokenizer, _DEEPSEEK_CHAT_TOKENS)
    ):
        return None
    return spec


def _has_tokens(tokenizer: object, tokens: tuple[str, ...]) -> bool:
    """Whether every token is an added (special) token of the tokenizer: the recipe encodes
    them from the added vocabulary only (a word-level vocabulary entry does not count)."""
    try:
        added = tokenizer.get_added_vocab()
    except Exception:
        return False
    return all(t in added for t in tokens)
