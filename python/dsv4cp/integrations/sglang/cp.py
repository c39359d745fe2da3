"""dsv4cp's CP group inside a SGLang scheduler process, from SGLang's own CP flags.

`SGLangCP.from_runtime()` reads SGLang's published parallel context (`--enable-prefill-cp`,
`--cp-strategy`, `attn_cp_size` as resolved: the TP size). `group_for(forward_batch)` is the
group one forward runs with: SGLang's attention-CP group (wrapped as a `TorchDistCPGroup`) when
SGLang itself counts the batch as a CP prefill (`sglang.srt.layers.cp.utils.is_cp_active`:
EXTEND or MIXED with at least cp new tokens), else a single-rank group (decode and short
extends run replicated on every rank, as in SGLang's own V4 CP).

Tokens are split once: resolution sets `enable_cp_tp_group_sharing` for a dsv4cp-served model
(`server_args.resolution_declarations`), so SGLang's `EagerRunner._execute_extend` calls
`model.forward` with the full batch instead of sharding the inputs; dsv4cp's layers apply the
interleave split (`dsv4cp.cp.layout.CPLayout`, the same layout as SGLang's
`InterleaveCPStrategy`, see tests/sglang/test_cp_contract.py).
"""

from __future__ import annotations

from collections.abc import Callable

from dsv4cp.cp.group import CPGroup, SingleCPGroup
from dsv4cp.integrations.sglang.server_args import CPSettings, cp_settings_from_server_args

__all__ = ["SGLangCP"]


def _attn_cp_group() -> CPGroup:
    from sglang.srt.distributed.parallel_state import get_attn_cp_group

    from dsv4cp.cp.dist import TorchDistCPGroup

    return TorchDistCPGroup(get_attn_cp_group().device_group)


def _sglang_cp_active(forward_batch: object) -> bool:
    from sglang.srt.layers.cp.utils import is_cp_active

    return bool(is_cp_active(forward_batch))


class SGLangCP:
    """Chooses the CP group of each forward; the process group is built on first use."""

    def __init__(
        self,
        settings: CPSettings,
        *,
        group_factory: Callable[[], CPGroup] = _attn_cp_group,
        is_active: Callable[[object], bool] = _sglang_cp_active,
    ) -> None:
        self.settings = settings
        self._factory = group_factory
        self._is_active = is_active
        self._group: CPGroup | None = None

    @classmethod
    def from_runtime(cls) -> SGLangCP:
        """From the server args SGLang published in this process (the scheduler)."""
        from sglang.srt.runtime_context import get_parallel

        return cls(cp_settings_from_server_args(get_parallel()))

    def group_for(self, forward_batch: object) -> CPGroup:
        if not self.settings.enabled or not self._is_active(forward_batch):
            return SingleCPGroup()
        if self._group is None:
            group = self._factory()
            if group.cp_size != self.settings.size:
                raise ValueError(
                    f"dsv4cp: SGLang's attention-CP group has {group.cp_size} ranks, "
                    f"the server args ask for {self.settings.size}"
                )
            self._group = group
        return self._group
