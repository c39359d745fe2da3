"""Which checkpoints dsv4cp serves, which SGLang flags apply to them, and how CP flags map.

Selection: a dsv4cp export (`model_type` MODEL_TYPE) is always served by dsv4cp; an upstream
DeepSeek-V4.1 checkpoint (`model_type` "deepseek_v41") only with `--model-impl dsv4cp`
(MODEL_IMPL), else SGLang's own model serves it, untouched.

CP: `--enable-prefill-cp --cp-strategy interleave` with `--tp N` runs dsv4cp's interleave CP
over SGLang's attention-CP group, which is the whole TP group (`--attn-cp-size` is N or unset).
The resolution declarations below keep SGLang from sharding the inputs itself: the model gets
the full batch and splits it once, in its layers (see `cp.py`).

`check_server_args` raises Dsv4cpServerArgsError (a ValueError) with one line naming the flag;
it reads a raw ServerArgs record or a resolving view, imports nothing from sglang.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from typing import Any

from dsv4cp.config import UPSTREAM_MODEL_TYPE
from dsv4cp.integrations.sglang import MODEL_TYPE

__all__ = [
    "CONFIG_PARSER",
    "MODEL_IMPL",
    "UPSTREAM_MODEL_TYPE",
    "CPSettings",
    "Dsv4cpServerArgsError",
    "ModelOverrides",
    "check_server_args",
    "cp_settings_from_server_args",
    "resolution_declarations",
    "dsv4cp_requested",
    "served_by_dsv4cp",
    "SWA_FULL_TOKENS_RATIO",
]

MODEL_IMPL = "dsv4cp"
CONFIG_PARSER = "dsv4cp"  # the model-config parser --model-impl dsv4cp selects (config_parser.py)
# SGLang's attention backend is built but never called by dsv4cp's layers; torch_native plans
# nothing per batch, and SGLang turns its CUDA graphs off for it (they cannot record the
# model's host-side metadata).
ATTENTION_BACKEND = "torch_native"
# SGLang's hybrid-SWA pool holds ratio × --max-total-tokens SWA slots (dsv4cp's SWA rows and
# ratio-2 pair rows, ~33 KB per slot at Flash dims against ~0.9 KB per full slot); SGLang's
# own V4 default when the ratio is not given. docs/sglang.md, *Caches*, says how to size it.
SWA_FULL_TOKENS_RATIO = 0.1
# SGLang flags that copy its KV pool to host or storage and back (dsv4cp's caches are not in it).
HOST_KV_FLAGS = (
    "enable_hierarchical_cache",
    "enable_lmcache",
    "enable_flexkv",
    "enable_unified_cache_external_linker",
)


logger = logging.getLogger(__name__)
_warned: set[str] = set()  # check_server_args runs twice per launch: each warning once


class Dsv4cpServerArgsError(ValueError):
    """A flag (combination) a dsv4cp-served model cannot run with; the message is one line."""


@dataclass(frozen=True)
class CPSettings:
    """dsv4cp's CP in a SGLang server: `size` ranks (1: no CP), interleave split."""

    size: int = 1
    strategy: str | None = None

    @property
    def enabled(self) -> bool:
        return self.size > 1


def _get(args: Any, name: str, default: Any = None) -> Any:
    return getattr(args, name, default)


def _value(v: object) -> str:
    return str(getattr(v, "value", v)).lower()  # SGLang's ModelImpl is a str Enum


def dsv4cp_requested(model_impl: object, model_config_parser: object = "auto") -> bool:
    """`--model-impl dsv4cp` (or the parser it selects, `--model-config-parser dsv4cp`)."""
    return MODEL_IMPL in (_value(model_impl), _value(model_config_parser))


def served_by_dsv4cp(model_type: str | None, args: Any) -> bool:
    """Whether dsv4cp serves a checkpoint of `model_type` under the server args `args`."""
    impl, parser = (
        _value(_get(args, "model_impl", "auto")),
        _value(_get(args, "model_config_parser", "auto")),
    )
    requested = dsv4cp_requested(impl, parser)
    if parser not in ("auto", CONFIG_PARSER) and requested:
        raise Dsv4cpServerArgsError(
            f"dsv4cp: --model-impl {MODEL_IMPL} parses config.json itself; drop "
            f"--model-config-parser {parser}"
        )
    if parser == CONFIG_PARSER and impl not in ("auto", MODEL_IMPL):
        raise Dsv4cpServerArgsError(
            f"dsv4cp: --model-config-parser {CONFIG_PARSER} selects dsv4cp's implementation; "
            f"drop --model-impl {impl} or the parser"
        )
    if model_type == MODEL_TYPE:
        if impl not in ("auto", MODEL_IMPL):
            raise Dsv4cpServerArgsError(
                f"dsv4cp: a dsv4cp export ({MODEL_TYPE}) has only dsv4cp's implementation; "
                f"drop --model-impl {impl}"
            )
        return True
    if not requested:
        return False
    if model_type != UPSTREAM_MODEL_TYPE:
        raise Dsv4cpServerArgsError(
            f"dsv4cp: --model-impl {MODEL_IMPL} serves DeepSeek-V4.1 checkpoints "
            f"(model_type {UPSTREAM_MODEL_TYPE}) and dsv4cp exports; this one has "
            f"model_type {model_type!r}"
        )
    return True


def _cuda(args: Any) -> bool:
    device = _get(args, "device")
    if device is not None:
        return str(device).split(":")[0] == "cuda"
    import torch

    return torch.cuda.is_available()


@dataclass(frozen=True)
class ModelOverrides:
    """dsv4cp's serving options, given as `--json-model-override-args` keys (SGLang sets them
    on the HF config the model class receives); any other key is refused:

    - `dsv4cp_quant`: "qat" | "none" (default: qat for a checkpoint with a quantization_config);
    - `dsv4cp_graphs`: token buckets of breakable CUDA graphs (CUDA; default: eager only);
    - `dsv4cp_graph_max_requests`: requests per captured batch (default 8).
    """

    quant: str | None = None
    graphs: tuple[int, ...] = ()
    graph_max_requests: int = 8

    KEYS = ("dsv4cp_quant", "dsv4cp_graphs", "dsv4cp_graph_max_requests")

    @classmethod
    def parse(cls, value: object) -> ModelOverrides:
        """From `--json-model-override-args` (a JSON string or a dict); one-line errors."""
        if value is None or value == "":
            return cls()
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except ValueError:
                raise Dsv4cpServerArgsError(
                    "dsv4cp: --json-model-override-args is not valid JSON"
                ) from None
        if not isinstance(value, dict):
            raise Dsv4cpServerArgsError("dsv4cp: --json-model-override-args must be an object")
        unknown = sorted(set(value) - set(cls.KEYS))
        if unknown:
            raise Dsv4cpServerArgsError(
                f"dsv4cp: --json-model-override-args key(s) {unknown} not supported (only "
                f"{list(cls.KEYS)}); edit the checkpoint's config.json"
            )
        return cls.of_mapping(value)

    @classmethod
    def of_mapping(cls, value: dict[str, Any]) -> ModelOverrides:
        quant = value.get("dsv4cp_quant")
        if quant is not None and quant not in ("qat", "none"):
            raise Dsv4cpServerArgsError(
                f'dsv4cp: dsv4cp_quant must be "qat" or "none", got {quant!r}'
            )
        graphs = value.get("dsv4cp_graphs", [])
        if graphs is None:  # an HF config attribute left unset
            graphs = []
        if not isinstance(graphs, list) or not all(
            isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in graphs
        ):
            raise Dsv4cpServerArgsError(
                f"dsv4cp: dsv4cp_graphs must be a list of positive token counts, got {graphs!r}"
            )
        reqs = value.get("dsv4cp_graph_max_requests", 8)
        if isinstance(reqs, bool) or not isinstance(reqs, int) or reqs < 1:
            raise Dsv4cpServerArgsError(
                f"dsv4cp: dsv4cp_graph_max_requests must be a positive int, got {reqs!r}"
            )
        if "dsv4cp_graph_max_requests" in value and not graphs:
            raise Dsv4cpServerArgsError(
                "dsv4cp: dsv4cp_graph_max_requests has no effect without dsv4cp_graphs"
            )
        return cls(quant, tuple(graphs), reqs)

    @classmethod
    def of_hf_config(cls, hf_config: object) -> ModelOverrides:
        """The keys SGLang set on the model's HF config (attributes)."""
        return cls.of_mapping(
            {k: getattr(hf_config, k) for k in cls.KEYS if getattr(hf_config, k, None) is not None}
        )


def _parse_overrides(value: object) -> tuple[ModelOverrides | None, str | None]:
    """(the overrides, None), or (None, the one-line refusal)."""
    try:
        return ModelOverrides.parse(value), None
    except Dsv4cpServerArgsError as e:
        return None, str(e)


def _refusals(args: Any) -> list[tuple[bool, str]]:
    """(condition, message): the first true condition refuses the launch."""
    tp = int(_get(args, "tp_size", 1) or 1)
    prefill_cp = bool(_get(args, "enable_prefill_cp", False))
    strategy = _get(args, "cp_strategy")
    attn_cp = int(_get(args, "attn_cp_size", 1) or 1)
    attention = {
        flag: _get(args, field)
        for flag, field in (
            ("--attention-backend", "attention_backend"),
            ("--prefill-attention-backend", "prefill_attention_backend"),
            ("--decode-attention-backend", "decode_attention_backend"),
        )
    }
    bad_attention = next(
        (f"{f} {v}" for f, v in attention.items() if v not in (None, ATTENTION_BACKEND)), None
    )
    device = _get(args, "device")
    overrides, bad_overrides = _parse_overrides(_get(args, "json_model_override_args"))
    return [
        (
            device is not None and str(device).split(":")[0] not in ("cpu", "cuda"),
            f"dsv4cp: --device {device} is not supported (cpu or cuda)",
        ),
        # --- parallelism: dsv4cp replicates weights and splits tokens (CP) -----------------
        (
            prefill_cp and strategy == "zigzag",
            "dsv4cp: --cp-strategy zigzag is not supported yet; use --cp-strategy interleave",
        ),
        (
            prefill_cp and strategy is None,
            "dsv4cp: --enable-prefill-cp needs --cp-strategy interleave",
        ),
        (
            not prefill_cp and strategy is not None,
            f"dsv4cp: --cp-strategy {strategy} has no effect without --enable-prefill-cp",
        ),
        (
            attn_cp not in (1, tp),
            f"dsv4cp: --attn-cp-size {attn_cp} must equal --tp {tp}: dsv4cp runs CP over the "
            "whole TP group (it has no attention tensor parallelism)",
        ),
        (
            not prefill_cp and attn_cp > 1,
            "dsv4cp: --attn-cp-size needs --enable-prefill-cp --cp-strategy interleave",
        ),
        (
            not prefill_cp and tp > 1,
            f"dsv4cp: --tp {tp} needs --enable-prefill-cp --cp-strategy interleave: dsv4cp has "
            "no tensor parallelism, its ranks split the prompt tokens (CP)",
        ),
        (int(_get(args, "pp_size", 1) or 1) > 1, "dsv4cp: --pp-size > 1 is not supported"),
        (
            int(_get(args, "dp_size", 1) or 1) > 1
            or int(_get(args, "attn_dp_size", 1) or 1) > 1
            or bool(_get(args, "enable_dp_attention", False)),
            "dsv4cp: data parallelism (--dp-size, --attn-dp-size, --enable-dp-attention) is not "
            "supported; run one server per replica",
        ),
        (int(_get(args, "dcp_size", 1) or 1) > 1, "dsv4cp: --dcp-size > 1 is not supported"),
        (
            int(_get(args, "ep_size", 1) or 1) > 1
            or (_get(args, "moe_a2a_backend") or "none") != "none"
            or (_get(args, "moe_runner_backend") or "auto") != "auto",
            "dsv4cp: --ep-size, --moe-a2a-backend and --moe-runner-backend do not apply: dsv4cp "
            "runs its own FFN",
        ),
        (
            bool(_get(args, "enable_two_batch_overlap", False)),
            "dsv4cp: --enable-two-batch-overlap is not supported",
        ),
        # --- features dsv4cp's model does not have -------------------------------------------
        (
            _get(args, "speculative_algorithm") is not None,
            "dsv4cp: speculative decoding (--speculative-algorithm) is not supported",
        ),
        (
            _get(args, "quantization") is not None,
            "dsv4cp: --quantization does not apply: dsv4cp reads the checkpoint's own "
            "quantization_config",
        ),
        (
            (_get(args, "kv_cache_dtype") or "auto") != "auto",
            "dsv4cp: --kv-cache-dtype does not apply: dsv4cp's caches store the formats of its "
            "numerics (qat: fp8 SWA rows, fp4 compressed and index keys)",
        ),
        (
            bad_attention is not None,
            f"dsv4cp: {bad_attention} does not apply: dsv4cp runs "
            "its own attention (SGLang's backend is fixed to torch_native, unused)",
        ),
        (
            (_get(args, "dsv4_attn_backend") or "auto") != "auto",
            "dsv4cp: --dsv4-attn-backend does not apply: dsv4cp runs its own attention",
        ),
        (
            bool(_get(args, "enable_lora")) or bool(_get(args, "lora_paths")),
            "dsv4cp: LoRA adapters are not supported",
        ),
        (
            bool(_get(args, "enable_multimodal")),
            "dsv4cp: --enable-multimodal is not supported: a dsv4cp-served model is text-only",
        ),
        (bool(_get(args, "is_embedding")), "dsv4cp: --is-embedding is not supported"),
        (
            (_get(args, "disaggregation_mode") or "null") != "null",
            "dsv4cp: PD disaggregation is not supported (dsv4cp's cache is not SGLang's KV pool)",
        ),
        (bool(_get(args, "enable_hisparse", False)), "dsv4cp: --enable-hisparse is not supported"),
        (
            any(_get(args, f, False) for f in HOST_KV_FLAGS),
            "dsv4cp: "
            + ", ".join("--" + f.replace("_", "-") for f in HOST_KV_FLAGS if _get(args, f, False))
            + " not supported: they move SGLang's KV pool to and from host or storage, and "
            "dsv4cp's caches are not in it",
        ),
        (
            bool(_get(args, "enable_unified_memory", False)),
            "dsv4cp: --enable-unified-memory is not supported (dsv4cp keys its SWA rows on "
            "SGLang's hybrid-SWA allocator, tested with separate full and SWA pools)",
        ),
        (
            bad_overrides is not None,
            str(bad_overrides),
        ),
        (
            overrides is not None and bool(overrides.graphs) and not _cuda(args),
            "dsv4cp: dsv4cp_graphs (CUDA graphs) needs --device cuda",
        ),
        (
            _get(args, "max_total_tokens") is None and _cuda(args),
            "dsv4cp: pass --max-total-tokens on CUDA: dsv4cp's cache is sized from it while the "
            "model loads, before SGLang sizes its own (unused) pool",
        ),
    ]


def check_server_args(args: Any) -> CPSettings:
    """Validate the flags of a dsv4cp-served model and its DSV4CP_* environment (a bad value
    would otherwise fail the first forward in the scheduler); return its CP settings."""
    check_environment()
    for refused, message in _refusals(args):
        if refused:
            raise Dsv4cpServerArgsError(message)
    return cp_settings_from_server_args(args)


def check_environment() -> None:
    """Every set DSV4CP_* variable parsed (Dsv4cpServerArgsError names a bad one); an unknown
    DSV4CP_* name is logged once as a warning."""
    from dsv4cp.routing import check_environment as check_dsv4cp_environment

    try:
        warnings = check_dsv4cp_environment()
    except ValueError as e:
        raise Dsv4cpServerArgsError(f"dsv4cp: {e}") from None
    for line in warnings:
        if line not in _warned:
            _warned.add(line)
            logger.warning("dsv4cp: %s", line)


def cp_settings_from_server_args(args: Any) -> CPSettings:
    """dsv4cp's CP from SGLang's flags: `--enable-prefill-cp --cp-strategy interleave` over
    `--tp N` ranks; `args` is a raw ServerArgs, a resolving view or SGLang's parallel context."""
    if not _get(args, "enable_prefill_cp", False):
        return CPSettings()
    strategy = _get(args, "cp_strategy")
    if strategy != "interleave":
        raise Dsv4cpServerArgsError(
            f"dsv4cp: only --cp-strategy interleave is supported, got {strategy!r}"
        )
    size = int(_get(args, "attn_cp_size", 1) or 1)
    tp = _get(args, "tp_size")
    if size == 1 and tp is not None:  # a raw record: resolution sets attn_cp_size = tp
        size = int(tp)
    return CPSettings(size=size, strategy="interleave" if size > 1 else None)


def resolution_declarations(args: Any) -> dict[str, Any]:
    """SGLang server-arg values a dsv4cp-served model needs (a model-override provider's dict).

    - attention_backend: torch_native (unused by dsv4cp; no per-batch planning, no CUDA graphs);
    - swa_full_tokens_ratio: SWA_FULL_TOKENS_RATIO unless `--swa-full-tokens-ratio` is given
      (SGLang's generic default, 0.8, would keep an SWA row for most token slots);
    - with CP: attn_cp_size = tp (the attention-CP group is the TP group, as for SGLang's V4),
      enable_cp_tp_group_sharing: SGLang's runner then hands the model the full batch instead
      of sharding the inputs itself (`EagerRunner._execute_extend`); dsv4cp splits it.
    """
    out: dict[str, Any] = {"attention_backend": ATTENTION_BACKEND}
    if _get(args, "swa_full_tokens_ratio") is None:
        out["swa_full_tokens_ratio"] = SWA_FULL_TOKENS_RATIO
    cp = cp_settings_from_server_args(args)
    if cp.enabled:
        out["attn_cp_size"] = cp.size
        out["enable_cp_tp_group_sharing"] = True
    return out
