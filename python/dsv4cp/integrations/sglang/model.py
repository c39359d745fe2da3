"""`DeepseekV41ForCausalLM` as SGLang's ModelRunner loads it: dsv4cp's model behind SGLang's API.

SGLang's contract (0.5.23): `cls(config=hf_config, quant_config=...)` under
`set_default_torch_dtype(model dtype)` and `with torch.device(target)`; `load_weights(iterable of
(name, tensor))`; `forward(input_ids, positions, forward_batch)` → `LogitsProcessorOutput` via
SGLang's `LogitsProcessor` (it keeps the last token of each request, or every token when input
logprobs are asked for, and applies the head).

Caches: SGLang owns token slots (its allocator, radix cache and `req_to_token`); dsv4cp's
`KVCache` is indexed by the same slots, so `out_cache_loc` is dsv4cp's write slot and SGLang's
`req_to_token` row (copied as int64) is dsv4cp's position → slot table. SGLang's own KV pool for
this architecture is allocated (sized by `--max-total-tokens`) but never read or written. The
dsv4cp cache is built at the first forward, sized from SGLang's pools.

Ratio-2 pair state: every even token leaves its fp32 kv/gate at its slot, so a forward starting
at an odd position (next chunk, decode, or a radix-cache prefix of odd length shared by another
request) finds its partner: any `--page-size` works.

CP: `DSV4CP_SGLANG_CP=tp` runs dsv4cp's own interleave CP over SGLang's TP group (SGLang gives
every TP rank the same batch; caches are replicated), extend batches with >= cp tokens only.
SGLang's own `--enable-prefill-cp` shards model inputs itself and is refused.
Multistream prepare: `DSV4CP_MULTISTREAM=on|off|auto` (dsv4cp's `MultistreamPolicy` through the
same `ExecutorFactory` as the runner, CUDA only). Batches here run eagerly, so "auto" turns it on
from `min_tokens_eager` (8192) local tokens, where eager multistream measured faster.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

import torch
from torch import Tensor, nn

from dsv4cp.batch import build_metadata
from dsv4cp.cache import KVCache
from dsv4cp.config import DeepseekV41Config
from dsv4cp.context import ForwardContext
from dsv4cp.cp.group import CPGroup
from dsv4cp.executors import ExecutorFactory
from dsv4cp.integrations.sglang.cp import SGLangCP
from dsv4cp.integrations.sglang.forward_batch import (
    SGLangBatch,
    from_forward_batch,
    sync_req_to_token,
)
from dsv4cp.integrations.sglang.server_args import CPSettings, cp_settings_from_server_args
from dsv4cp.model import DeepseekV41Model
from dsv4cp.ops import rms_norm
from dsv4cp.policy import MultistreamPolicy

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


class DeepseekV41ForCausalLM(nn.Module):
    def __init__(
        self, config: object, quant_config: object = None, prefix: str = "", **_: object
    ) -> None:
        super().__init__()
        from sglang.srt.layers.logits_processor import LogitsProcessor

        if quant_config is not None:
            raise ValueError("dsv4cp: quantized checkpoints are not supported (QuantMode none)")
        raw = getattr(config, "dsv4cp_config", None)
        if not raw:
            raise ValueError("dsv4cp: the HF config has no dsv4cp_config (not a dsv4cp checkpoint)")
        self.config = config
        self.dsv4cp_config = DeepseekV41Config.from_hf(dict(raw))
        self._cp = SGLangCP(CPSettings())  # no CP unless SGLang published its CP flags
        max_total_tokens, page_size = self._check_server_args()
        self.dsv4cp = DeepseekV41Model(
            self.dsv4cp_config,
            dtype=torch.get_default_dtype(),
            device=torch.get_default_device(),
            seed=None,
        )
        # The head is replicated, not vocab-parallel: never all-gather logits over TP.
        self.logits_processor = LogitsProcessor(config, skip_all_gather=True)
        self.lm_head = _Head(self.dsv4cp)
        self.ratios = sorted({r for r in self.dsv4cp_config.layer_ratios if r})
        self.executors = ExecutorFactory.create(
            MultistreamPolicy.from_env(),
            device=self.dsv4cp.device,
            lanes=self.dsv4cp.prepare_lanes(),
        )
        # Allocated now when the slot count is known, so that SGLang's memory profile (taken
        # after loading) counts it before sizing its own pool; else at the first forward.
        self.cache: KVCache | None = None
        if max_total_tokens:
            self.cache = self._new_cache(max_total_tokens + 2 * page_size, page_size)

    # ------------------------------------------------------------------ setup
    def _check_server_args(self) -> tuple[int | None, int]:
        """(max_total_tokens or None, page size) from SGLang's published config; validates."""
        try:
            from sglang.srt.runtime_context import get_parallel, get_schedule

            parallel, schedule = get_parallel(), get_schedule()
        except Exception:  # not published (the class built by hand, outside a server)
            return None, 1
        self._cp = SGLangCP(cp_settings_from_server_args(parallel))
        page_size = getattr(schedule, "page_size", None) or 1
        max_total = getattr(schedule, "max_total_tokens", None)
        if not max_total and torch.get_default_device().type == "cuda":
            raise ValueError(
                "dsv4cp: pass --max-total-tokens on CUDA: dsv4cp's KV cache is sized from it "
                "before SGLang gives the rest of the memory to its own (unused) pool"
            )
        return max_total, page_size

    def _new_cache(self, num_slots: int, page_size: int, rows: int = 1, width: int = 1) -> KVCache:
        m = self.dsv4cp
        return KVCache(
            self.dsv4cp_config,
            num_slots,
            max_requests=rows,
            max_context=width,
            page_size=page_size,
            device=m.device,
            dtype=m.dtype,
        )

    def _cache_for(self, forward_batch: Any) -> tuple[KVCache, Tensor]:
        pool, r2t = _pools(forward_batch)
        cache = self.cache
        if cache is None or cache.req_to_token.shape != r2t.shape:
            page = int(getattr(pool, "page_size", 1))
            need = int(pool.size) + 2 * page  # SGLang's slots are 1..size (+ page padding)
            if cache is None or cache.num_slots < need:
                if cache is not None:
                    logger.warning(
                        "dsv4cp: SGLang's pool holds %d slots, more than the %d "
                        "allocated; reallocating",
                        pool.size,
                        cache.num_slots,
                    )
                cache = self.cache = self._new_cache(need, page)
            # dsv4cp's own int64 position -> slot table, shaped like SGLang's req_to_token.
            cache.req_to_token = torch.zeros(r2t.shape, dtype=torch.long, device=cache.device)
            cache.max_requests, cache.max_context = r2t.shape
            logger.info(
                "dsv4cp: KV cache of %d slots, %d request rows x %d positions",
                cache.num_slots,
                *r2t.shape,
            )
        return cache, r2t

    # ------------------------------------------------------------------ weights
    def load_weights(self, weights: Iterable[tuple[str, Tensor]]) -> None:
        self.dsv4cp.load_state(dict(weights), strict=True)

    def get_input_embeddings(self) -> nn.Module:
        return nn.Embedding.from_pretrained(self.dsv4cp.embed, freeze=True)

    # ------------------------------------------------------------------ forward
    def hidden_states(self, batch: SGLangBatch, cache: KVCache, cp: CPGroup) -> Tensor:
        """Global rows [T, d] after the last layer (before the final norm)."""
        pb = batch.prefill_batch()
        meta = build_metadata(pb, cache.req_to_token, batch.slots.to(cache.device), self.ratios)
        ctx = ForwardContext.for_rank(meta, cache, cp)
        executors = self.executors.choose(ctx.local_rows, graphs=False)
        return self.dsv4cp.forward(batch.input_ids.to(cache.device), ctx, executors)

    @torch.no_grad()
    def forward(self, input_ids: Tensor, positions: Tensor, forward_batch: Any, **_: object) -> Any:
        m = self.dsv4cp
        batch = from_forward_batch(forward_batch)
        if batch.num_tokens == 0:
            hidden = torch.zeros(0, m.config.hidden_size, dtype=m.dtype, device=m.device)
        else:
            cache, r2t = self._cache_for(forward_batch)
            sync_req_to_token(cache.req_to_token, r2t, batch)
            hidden = self.hidden_states(batch, cache, self._cp.group_for(forward_batch))
        normed = rms_norm(hidden, m.norm, m.config.rms_norm_eps)
        return self.logits_processor(input_ids, normed, self.lm_head, forward_batch)


EntryClass = [DeepseekV41ForCausalLM]
