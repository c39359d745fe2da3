"""When does the multistream prepare pay? A per-batch decision from measured thresholds.

Eager multistream costs host time per stream switch and event: on the H200 it lost up to 4096
local tokens and won (2–7%) at 8192, where the GPU work hides the launches. Inside a CUDA graph
the forks and joins are free graph edges and the overlap paid at every size measured (512–8192)
for layers with a compressor or an indexer, and for the SWA layers at a CP 4 and CP 8 rank's
rows (up to 4096, the most measured); the layers that reuse a top-k measured from 1.9 % slower
to 1.1 % faster with streams and stay serial. The defaults come from
`benchmarks/prepare_overlap.py` and `benchmarks/layer_peer.py`'s CP rows (docs/performance.md
§3, §21). With mode "auto", `DSV4CP_MULTISTREAM=on|off|auto` overrides the mode and
`DSV4CP_MULTISTREAM_MAX_TOKENS=N` the graph threshold (`max_tokens_graph`); the eager threshold
has no variable.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from dsv4cp import env_vars
from dsv4cp.roles import LayerRole

log = logging.getLogger("dsv4cp.policy")

# Largest local token count at which graph-captured multistream beat serial on the H200.
DEFAULT_MAX_TOKENS_GRAPH = 8192
# Smallest local token count at which eager multistream beat eager serial on the H200.
DEFAULT_MIN_TOKENS_EAGER = 8192
# Largest local token count at which the SWA layers measured faster with streams (in graphs, a
# CP 4 rank of a 16K chunk); above it they were not measured faster (CP 1's 16K rows: serial).
SWA_MAX_TOKENS = 4096


MODES = ("auto", "on", "off")


@dataclass
class MultistreamPolicy:
    mode: str = "auto"  # "auto" | "on" | "off"
    max_tokens_graph: int = DEFAULT_MAX_TOKENS_GRAPH
    min_tokens_eager: int = DEFAULT_MIN_TOKENS_EAGER
    _logged: set[tuple[int, bool]] = field(default_factory=set, repr=False)

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"multistream mode must be auto, on or off, got {self.mode!r}")
        if self.max_tokens_graph < 0:
            raise ValueError(f"max_tokens_graph must be >= 0, got {self.max_tokens_graph}")
        if self.min_tokens_eager < 0:
            raise ValueError(f"min_tokens_eager must be >= 0, got {self.min_tokens_eager}")

    @classmethod
    def of(cls, multistream: bool | str) -> MultistreamPolicy:
        """True/False force the executor on/off; a mode string goes through `from_env`."""
        if isinstance(multistream, str):
            return cls.from_env(multistream)
        return cls(mode="on" if multistream else "off")

    @classmethod
    def from_env(cls, mode: str | None = None, max_tokens: int | None = None) -> MultistreamPolicy:
        if max_tokens is None:
            max_tokens = env_vars.read("DSV4CP_MULTISTREAM_MAX_TOKENS")
        if mode in (None, "auto"):
            mode = env_vars.read("DSV4CP_MULTISTREAM") or mode
        return cls(
            mode=mode or "auto",
            max_tokens_graph=DEFAULT_MAX_TOKENS_GRAPH if max_tokens is None else max_tokens,
        )

    def layer_pays(self, role: LayerRole, local_tokens: int) -> bool:
        """Layers with a compressor or an indexer fork in auto mode, and the SWA layers up to
        SWA_MAX_TOKENS local tokens: their whole-layer graph time at a CP rank's 2K / 4K rows
        was 0.8–5.3 % lower with streams (12 samples each, docs/performance.md §21), and at
        CP 1's 16K rows the serial executor was the faster. The top-k reuse layers, whose
        prepare is the same, measured from 1.9 % slower to 1.1 % faster and stay serial.
        Forced modes apply to every layer."""
        if self.mode != "auto":
            return True
        if role.owns_compressor or role.index_source:
            return True
        return not role.compressed and local_tokens <= SWA_MAX_TOKENS

    def decide(self, local_tokens: int, *, graphs: bool, cuda: bool) -> bool:
        if self.mode == "off":
            use, why = False, "forced off"
        elif not cuda:
            use, why = False, "CPU has no streams"
        elif self.mode != "auto":
            use, why = self.mode == "on", f"forced {self.mode}"
        elif not graphs and local_tokens < self.min_tokens_eager:
            use = False
            why = (
                f"eager, {local_tokens} local tokens < {self.min_tokens_eager}: "
                "launch overhead outweighs the overlap"
            )
        elif not graphs:
            use, why = True, f"eager, {local_tokens} local tokens >= {self.min_tokens_eager}"
        elif local_tokens > self.max_tokens_graph:
            use, why = False, f"{local_tokens} local tokens > {self.max_tokens_graph}"
        else:
            use, why = True, f"{local_tokens} local tokens <= {self.max_tokens_graph}"
        key = (local_tokens, graphs)
        if key not in self._logged:
            self._logged.add(key)
            log.info(
                "multistream %s for %d local tokens (graphs=%s): %s",
                "on" if use else "off",
                local_tokens,
                graphs,
                why,
            )
        return use
