"""Observability, off the model's path: `timing.stage` (the one instrumentation call the model
makes: an NVTX range plus the current host stage timer), `profiling` (torch.profiler traces),
`timeline` (the overlap metric and the stream-timeline PNG)."""
