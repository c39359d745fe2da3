"""Serve dsv4cp checkpoints through `python -m sglang.launch_server` (see docs/sglang.md).

- `plugin.register`: the `sglang.srt.plugins` entry point (config class, parser, model class,
  model-override provider, hooks);
- `server_args`: which checkpoints dsv4cp serves (`--model-impl dsv4cp`), which flags apply,
  the CP-flag mapping; `cp`: the CP group of each forward in the scheduler;
- `hf_config`: the transformers config class of a dsv4cp-served model (`model_type` below);
  `config_parser`: the "dsv4cp" model-config parser for upstream DeepSeek-V4.1 configs;
- `request_validation`: request checks on top of SGLang's;
- `model`: the class SGLang's ModelRunner instantiates for `ARCHITECTURE`;
- `forward_batch`: SGLang ForwardBatch → dsv4cp PrefillBatch + slots;
- `engine`: the forward without sglang (caches on SGLang's slots, executors, graphs).

Nothing here imports sglang at package import time.
"""

from __future__ import annotations

from dsv4cp.config import ARCHITECTURE, EXPORT_MODEL_TYPE

# A dsv4cp-served model's top-level `model_type` (an export's, and what `--model-impl dsv4cp`
# makes of an upstream config). It differs from upstream's "deepseek_v41" on purpose: SGLang
# rewrites that one to its own DeepseekV4ForCausalLM (configs/deepseek_v41.py) and applies
# V4-only defaults (dsv4 backend, page 256), which a dsv4cp-served model must avoid.
MODEL_TYPE = EXPORT_MODEL_TYPE
PACKAGE = __name__

__all__ = ["ARCHITECTURE", "MODEL_TYPE", "PACKAGE"]
