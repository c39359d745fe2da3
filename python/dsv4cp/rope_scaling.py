"""YaRN RoPE scaling parameters, shared by the config and the RoPE ops (attention-math §3)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from dsv4cp.config_fields import is_finite_number

_HF_NAMES = (
    ("factor", "factor"),
    ("original_max_position", "original_max_position_embeddings"),
    ("beta_fast", "beta_fast"),
    ("beta_slow", "beta_slow"),
)
_DEFAULT_BETAS = {"beta_fast": 32.0, "beta_slow": 1.0}  # the reference ModelArgs' defaults


@dataclass(frozen=True)
class YarnScaling:
    factor: float
    original_max_position: int
    beta_fast: float
    beta_slow: float

    @classmethod
    def from_hf(cls, raw: Any) -> YarnScaling | None:
        """Parse an HF `rope_scaling` dict (None or {} → no scaling); ValueError names the key.

        `factor` and `original_max_position_embeddings` are required; the betas default to 32
        and 1.
        """
        if not raw:
            return None
        if not isinstance(raw, dict):
            raise ValueError(f"rope_scaling: must be a dict, got {type(raw).__name__}")
        kind = raw.get("rope_type", raw.get("type"))
        if kind != "yarn":
            raise ValueError(f"rope_scaling: only yarn is supported, got {kind!r}")
        values: dict[str, Any] = {}
        for name, key in _HF_NAMES:
            if key not in raw and name not in _DEFAULT_BETAS:
                raise ValueError(f"rope_scaling.{key}: required for yarn scaling")
            v = raw.get(key, _DEFAULT_BETAS.get(name))
            if isinstance(v, bool) or not isinstance(v, (int, float)):
                raise ValueError(f"rope_scaling.{key}: must be a number, got {v!r}")
            values[name] = v
        # factor divides the frequencies; the betas go into log(omp / (2π·beta)) (`_yarn_band`).
        # NaN passes a plain `<= 0` test, hence the finiteness check. Either beta order is
        # accepted, as in DeepSeek's yarn code.
        for name, key in _HF_NAMES:
            v = values[name]
            if name != "original_max_position" and not (is_finite_number(v) and v > 0):
                raise ValueError(f"rope_scaling.{key}: must be a positive finite number, got {v!r}")
        omp = values["original_max_position"]
        if not isinstance(omp, int) or omp <= 0:
            raise ValueError(
                f"rope_scaling.original_max_position_embeddings: must be a positive integer, "
                f"got {omp!r}"
            )
        for key in ("beta_fast", "beta_slow"):  # a subnormal beta or a huge omp overflows it
            try:
                ok = is_finite_number(omp / (2 * math.pi * values[key]))
            except OverflowError:
                ok = False
            if not ok:
                raise ValueError(
                    f"rope_scaling.{key}: original_max_position_embeddings / (2π·{key}) must be "
                    f"a finite number, got {key}={values[key]!r} and {omp!r}"
                )
        return cls(
            float(values["factor"]), omp, float(values["beta_fast"]), float(values["beta_slow"])
        )

    def to_hf(self) -> dict[str, Any]:
        out: dict[str, Any] = {"type": "yarn", "rope_type": "yarn"}
        out.update({key: getattr(self, name) for name, key in _HF_NAMES})
        return out
