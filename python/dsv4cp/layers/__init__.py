"""The model's parts, one file each: `attention` (the V4.1 attention sub-layer) today; the
hyper-connections, the MoE and Engram join it."""

from dsv4cp.layers.attention import DeepseekV41Attention

__all__ = ["DeepseekV41Attention"]
