"""Breakable CUDA graphs: `bcg` (a forward as graph segments around eager breaks) and `runner`
(per-bucket static batches, capture, replay, eager fallback, and the one place that decides
which gathers become eager breaks)."""
