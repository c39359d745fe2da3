"""The one error type of checkpoint reading and loading."""

from __future__ import annotations


class CheckpointError(ValueError):
    """A checkpoint that cannot be read or does not match what the model expects; the message
    names the tensor and the file."""
