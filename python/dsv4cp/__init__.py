"""dsv4cp: DeepSeek-V4.1 prefill under context parallelism, as an SGLang model-runner extension."""

from __future__ import annotations

from dsv4cp.config import DeepseekV41Config
from dsv4cp.roles import LayerRole

__all__ = ["DeepseekV41Config", "LayerRole", "__version__"]
__version__ = "0.1.0"
