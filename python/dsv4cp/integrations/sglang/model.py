"""`DeepseekV41ForCausalLM` as SGLang's ModelRunner loads it: dsv4cp's model behind SGLang's API.

SGLang's contract (0.5.23): `cls(config=hf_config, quant_config=...)` under
`set_default_torch_dtype(model dtype)` and `with torch.device(target)`; `load_weights(iterable of
(name, tensor))`; `forward(input_ids, positions, forward_batch)` → `LogitsProcessorOutput` via
SGLang's `LogitsProcessor` (it keeps the last token of each request, or every token when input
logprobs are asked for, and applies the head).

Weights: a released-format DeepSeek-V4.1 checkpoint (`model_type: deepseek_v41`, served with
`--model-impl dsv4cp`) loads through dsv4cp's own loader (`loader.load_checkpoint`: fp8 weights
and their scales, fp4 experts, Engram tables as shard memmaps, the tokenizer's n-gram hasher;
vision and DSpark skipped by name), straight from the checkpoint directory: SGLang's weight
iterator is closed unread. A dsv4cp export (`dsv4cp_v41`) loads from SGLang's iterator.

Numerics: `qat` (the reference's fp8/fp4 steps, quantized caches) for a checkpoint with a
`quantization_config`, else `none`; `--json-model-override-args '{"dsv4cp_quant": "none"}'`
picks the other mode (`server_args.ModelOverrides`).

Forward: `ServingEngine` (engine.py, no sglang): caches on SGLang's token slots (SWA rows on
SGLang's SWA slots when its hybrid-SWA pools are on, `swa_pool_of`), executors, optional graphs.
CP: `SGLangCP.from_runtime()` (cp.py) at construction, `group_for(batch)` per forward.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from dsv4cp.config import DeepseekV41Config
from dsv4cp.cp.group import CPGroup
from dsv4cp.graphs.runner import GraphConfig
from dsv4cp.integrations.sglang.cp import SGLangCP
from dsv4cp.integrations.sglang.engine import ServingEngine, SWAPool
from dsv4cp.integrations.sglang.forward_batch import SGLangBatch, from_forward_batch
from dsv4cp.integrations.sglang.server_args import (
    UPSTREAM_MODEL_TYPE,
    CPSettings,
    ModelOverrides,
)
from dsv4cp.model import DeepseekV41Model
from dsv4cp.ops import rms_norm

logger = logging.getLogger(__name__)


class _Head:
    """What SGLang's LogitsProcessor reads of an LM head: `.weight` [V, d]."""

    def __init__(self, model: DeepseekV41Model) -> None:
        self._model = model

    @property
    def weight(self) -> Tensor:
        return self._model.head


def _pools(forward_batch: Any) -> tuple[Any, Tensor]:
    """(token_to_kv_pool, req_to_token) of this forward."""
    kv = getattr(forward_batch, "token_to_kv_pool", None)
    r2t = getattr(forward_batch, "req_to_token_pool", None)
    if kv is None or r2t is None:
        from sglang.srt.model_executor.forward_context import (
            get_req_to_token_pool,
            get_token_to_kv_pool,
        )

        kv, r2t = kv or get_token_to_kv_pool(), r2t or get_req_to_token_pool()
    return kv, r2t.req_to_token


def slot_count(pool: Any) -> tuple[int, int]:
    """(slots dsv4cp's cache needs, page size) for SGLang's token pool: its slots are
    1..size, plus page padding."""
    page = int(getattr(pool, "page_size", 1) or 1)
    return int(pool.size) + 2 * page, page


def _flag(bag: object, name: str) -> bool:
    try:
        return bool(getattr(bag, name, False))
    except Exception:  # a config bag that does not carry the field
        return False


def swa_pool_of(pool: Any) -> SWAPool | None:
    """SGLang's hybrid-SWA pools (an `SWAKVPool` whose allocator registered its full → SWA
    slot map), or None (`--disable-hybrid-swa-memory`: a plain token pool)."""
    mapping = getattr(pool, "full_to_swa_index_mapping", None)
    size_swa = getattr(pool, "size_swa", None)
    if mapping is None or size_swa is None:
        return None
    page = int(getattr(pool, "page_size", 1) or 1)
    return SWAPool(int(size_swa) + 2 * page, mapping)


def swa_rows_planned(max_total_tokens: int, page_size: int, ratio: float) -> int:
    """The SWA rows SGLang's hybrid-SWA pool will have for `--max-total-tokens` and
    `--swa-full-tokens-ratio` (`HybridSWAPoolConfigurator`: page-aligned full tokens times
    the ratio, page-aligned), plus page padding as `swa_pool_of` counts them."""
    full = max_total_tokens // page_size * page_size
    return int(full * ratio) // page_size * page_size + 2 * page_size


def small_swa_pool(
    swa_rows: int, window: int, chunk: int | None, max_total_tokens: int, ratio: float
) -> str | None:
    """A warning when SGLang's SWA pool holds fewer slots than one window plus one prefill chunk
    (`chunk` None: chunked prefill off, a whole prompt), else None. SGLang then shrinks prefill
    chunks to the free SWA slots, and under load a decode step can find no slot: measured on CPU
    (tiny model, W = 16, chunk 64, 34 SWA slots, 10 concurrent requests) SGLang 0.5.23 aborted a
    request with HTTP 500, "Out of memory even after retracting all other requests"; with 102
    slots the same load retracted requests and every answer equalled the runner's."""
    if chunk is None:
        return None
    need = window + chunk
    if swa_rows >= need:
        return None
    return (
        f"dsv4cp: SGLang's SWA pool holds ~{swa_rows} slots (--swa-full-tokens-ratio {ratio:g} x "
        f"--max-total-tokens {max_total_tokens}), fewer than one window plus one prefill chunk "
        f"({window} + {chunk} = {need}): prefill chunks are shrunk to the free SWA slots, and "
        "under load SGLang may abort a decoding request with HTTP 500 (out of memory after "
        f"retracting); give --swa-full-tokens-ratio >= {need / max_total_tokens:.3g} or a larger "
        "--max-total-tokens"
    )


def served_context(hf_config: object) -> int | None:
    """The longest request the server admits: SGLang's `context_len` (its `--context-length`,
    else the one it derives), which it sets on the model's HF config; max_position_embeddings
    when that is absent (the class built outside a server)."""
    context = getattr(hf_config, "context_len", None)
    return context or getattr(hf_config, "max_position_embeddings", None)


def dsv4cp_config_of(hf_config: object) -> DeepseekV41Config:
    """dsv4cp's config from the HF config SGLang built (hf_config.Dsv4cpConfig)."""
    raw = getattr(hf_config, "dsv4cp_config", None)
    if not raw:
        raise ValueError("dsv4cp: the HF config has no dsv4cp_config (not a dsv4cp checkpoint)")
    full: dict[str, Any] = {"text_config": dict(raw)}
    quant = getattr(hf_config, "dsv4cp_quantization_config", None)
    if quant:
        full["quantization_config"] = dict(quant)
    return DeepseekV41Config.from_hf(full)


class DeepseekV41ForCausalLM(nn.Module):
    def __init__(
        self, config: object, quant_config: object = None, prefix: str = "", **_: object
    ) -> None:
        super().__init__()
        from sglang.srt.layers.logits_processor import LogitsProcessor

        if quant_config is not None:
            raise ValueError(
                "dsv4cp: SGLang's quantization methods do not apply (dsv4cp reads the "
                "checkpoint's quantization_config itself)"
            )
        self.config = config
        self.dsv4cp_config = dsv4cp_config_of(config)
        overrides = ModelOverrides.of_hf_config(config)
        quant = overrides.quant or ("qat" if self.dsv4cp_config.quantization else "none")
        self.released = getattr(config, "dsv4cp_source_model_type", None) == UPSTREAM_MODEL_TYPE
        self.checkpoint_dir = Path(str(getattr(config, "_name_or_path", "") or ""))
        if self.released and not (self.checkpoint_dir / "config.json").is_file():
            raise ValueError(
                f"dsv4cp: --model-path {self.checkpoint_dir}: dsv4cp loads a released-format "
                "checkpoint from a local directory (download it first)"
            )
        self.cp = SGLangCP(CPSettings())  # no CP unless SGLang published its CP flags
        max_total_tokens, page_size, context, swa_ratio, chunk = self._read_server_args()
        self.dsv4cp = DeepseekV41Model(
            self.dsv4cp_config,
            dtype=torch.get_default_dtype(),
            device=torch.get_default_device(),
            seed=None,
            quant=quant,
        )
        graphs = None
        if overrides.graphs:
            graphs = GraphConfig(
                buckets=overrides.graphs,
                max_requests=overrides.graph_max_requests,
                max_context=context or 2048,
            )
        self.engine = ServingEngine(self.dsv4cp, graphs=graphs)
        # The head is replicated, not vocab-parallel: never all-gather logits over TP.
        self.logits_processor = LogitsProcessor(config, skip_all_gather=True)
        self.lm_head = _Head(self.dsv4cp)
        logger.info(
            "dsv4cp: %s checkpoint, quant=%s, dtype=%s, cp=%d, graphs=%s",
            "released-format" if self.released else "dsv4cp export",
            quant,
            self.dsv4cp.dtype,
            self.cp.settings.size,
            graphs.buckets if graphs else "off",
        )
        # Allocated now when the slot count is known, so that SGLang's memory profile (taken
        # after loading) counts it before sizing its own pool; else at the first forward.
        if max_total_tokens:
            swa_rows = None
            if swa_ratio is not None:
                swa_rows = swa_rows_planned(max_total_tokens, page_size, swa_ratio)
                why = small_swa_pool(
                    swa_rows - 2 * page_size,  # the pool's slots, without the page padding
                    self.dsv4cp_config.sliding_window,
                    chunk or context,
                    max_total_tokens,
                    swa_ratio,
                )
                if why:
                    logger.warning(why)
            self._preallocate(max_total_tokens + 2 * page_size, page_size, swa_rows)

    # ------------------------------------------------------------------ setup
    def _read_server_args(
        self,
    ) -> tuple[int | None, int, int | None, float | None, int | None]:
        """(max_total_tokens or None, page size, context length, the SWA pool's
        `--swa-full-tokens-ratio` or None without hybrid-SWA pools, the prefill chunk or None
        when chunked prefill is off) from SGLang's published config; the CP group from its CP
        flags."""
        try:
            from sglang.srt.runtime_context import get_memory, get_schedule

            schedule = get_schedule()
        except Exception:  # not published (the class built by hand, outside a server)
            return None, 1, None, None, None
        self.cp = SGLangCP.from_runtime()
        page_size = getattr(schedule, "page_size", None) or 1
        max_total = getattr(schedule, "max_total_tokens", None)
        if not max_total and torch.get_default_device().type == "cuda":
            raise ValueError(
                "dsv4cp: pass --max-total-tokens on CUDA: dsv4cp's KV cache is sized from it "
                "before SGLang gives the rest of the memory to its own (unused) pool"
            )
        context = served_context(self.config)
        swa_ratio = None
        disabled = any(_flag(bag, "disable_hybrid_swa_memory") for bag in (schedule, get_memory()))
        if getattr(self.config, "is_hybrid_swa", False) and not disabled:
            swa_ratio = float(schedule.swa_full_tokens_ratio)
        chunk = getattr(schedule, "chunked_prefill_size", None)
        return max_total, page_size, context, swa_ratio, chunk if chunk and chunk > 0 else None

    def _preallocate(self, num_slots: int, page_size: int, swa_rows: int | None) -> None:
        e = self.engine
        e.cache = e.new_cache(num_slots, page_size, (1, 1), swa_rows)

    # ------------------------------------------------------------------ weights
    def load_weights(self, weights: Iterable[tuple[str, Tensor]]) -> None:
        if not self.released:
            self.dsv4cp.load_state(dict(weights), strict=True)
            return
        close = getattr(weights, "close", None)
        if callable(close):  # SGLang's lazy iterator: nothing read
            close()
        from dsv4cp.loader import load_checkpoint

        report = load_checkpoint(self.dsv4cp, self.checkpoint_dir)
        logger.info(
            "dsv4cp: loaded %d tensors (%d dequantized, %d Engram tables) in %.1f s",
            report.loaded,
            len(report.dequantized),
            len(report.engram_tables) // 2,
            report.seconds,
        )

    def get_input_embeddings(self) -> nn.Module:
        return nn.Embedding.from_pretrained(self.dsv4cp.embed, freeze=True)

    # ------------------------------------------------------------------ forward
    def hidden_states(self, batch: SGLangBatch, forward_batch: Any, cp: CPGroup) -> Tensor:
        """Global rows [T, d] after the last layer (before the final norm)."""
        pool, r2t = _pools(forward_batch)
        slots, page = slot_count(pool)
        swa = swa_pool_of(pool)
        return self.engine.forward(batch, r2t, cp, num_slots=slots, page=page, swa=swa)

    @torch.no_grad()
    def forward(self, input_ids: Tensor, positions: Tensor, forward_batch: Any, **_: object) -> Any:
        m = self.dsv4cp
        batch = from_forward_batch(forward_batch)
        if batch.num_tokens == 0:
            hidden = torch.zeros(0, m.config.hidden_size, dtype=m.dtype, device=m.device)
        else:
            hidden = self.hidden_states(batch, forward_batch, self.cp.group_for(forward_batch))
        normed = rms_norm(hidden, m.norm, m.config.rms_norm_eps)
        return self.logits_processor(input_ids, normed, self.lm_head, forward_batch)


EntryClass = [DeepseekV41ForCausalLM]
