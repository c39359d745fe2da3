"""Serve dsv4cp checkpoints through `python -m sglang.launch_server` (see docs/sglang.md).

- `plugin.register`: the `sglang.srt.plugins` entry point (config class, model class, defaults);
- `hf_config`: the transformers config class of a dsv4cp checkpoint (`model_type` below);
- `model`: the class SGLang's ModelRunner instantiates for `ARCHITECTURE`;
- `forward_batch`: SGLang ForwardBatch → dsv4cp PrefillBatch + slots.

Nothing here imports sglang at package import time.
"""

from __future__ import annotations

# A dsv4cp checkpoint's top-level `model_type`. It differs from upstream's "deepseek_v41" on
# purpose: SGLang rewrites that one to its own DeepseekV4ForCausalLM (configs/deepseek_v41.py)
# and applies V4-only defaults (dsv4 backend, page 256), which a dsv4cp checkpoint must avoid.
MODEL_TYPE = "dsv4cp_v41"
ARCHITECTURE = "DeepseekV41ForCausalLM"
PACKAGE = __name__

__all__ = ["ARCHITECTURE", "MODEL_TYPE", "PACKAGE"]
