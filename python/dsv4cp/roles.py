"""V4.1 layer roles: which layer owns a compressor or an indexer, and whose results it reuses.

Layers sharing a compress ratio share one compressed KV and one index K, produced by the nearest
kv source of that ratio at or before them; a layer that is not an index source reuses the top-k
of the nearest index source. One index source may publish candidate blocks that the later index
sources of its ratio pick their top-k inside (attention-math §1.2, §5; the reference's
`kv_source_layers` / `index_source_layers` / `candidate_source_layer`, model.py `ModelArgs`).
"""

from __future__ import annotations

from dataclasses import dataclass

SUPPORTED_RATIOS = (0, 1, 2)


@dataclass(frozen=True)
class LayerRole:
    """What one attention layer computes and which earlier layers it reads from."""

    layer: int
    ratio: int
    kv_source: int | None  # layer whose compressed KV / index K this layer reads (itself if owner)
    owns_compressor: bool
    index_source: bool  # owns an indexer (wq_b, weights_proj) and computes its own top-k
    topk_from: int | None  # layer whose top-k this layer uses (itself if index source)
    candidate_source: bool  # publishes candidate blocks
    candidate_consumer: bool  # picks its top-k inside the published blocks

    @property
    def compressed(self) -> bool:
        return self.ratio != 0

    @property
    def name(self) -> str:
        if self.ratio == 0:
            return "swa"
        parts = [f"r{self.ratio}"]
        if self.owns_compressor:
            parts.append("kv_source")
        if self.candidate_source:
            parts.append("candidate_source")
        elif self.candidate_consumer:
            parts.append("candidate_consumer")
        elif self.index_source:
            parts.append("index_source")
        if not self.index_source:
            parts.append("reuse_topk")
        return "+".join(parts)


def _nearest(ids: tuple[int, ...], ratios: tuple[int, ...], i: int, r: int) -> int | None:
    """The last layer of `ids` at or before layer i with ratio r, or None."""
    best = None
    for j in ids:
        if j <= i and ratios[j] == r:
            best = j
    return best


def _check_wiring(
    ratios: tuple[int, ...],
    kv_sources: tuple[int, ...],
    index_sources: tuple[int, ...],
    candidate_source: int,
) -> None:
    """ValueError starting with the config field at fault."""
    n = len(ratios)
    for i, r in enumerate(ratios):
        if r not in SUPPORTED_RATIOS:
            raise ValueError(
                f"compress_ratios: layer {i} has ratio {r}; V4.1 supports "
                f"{SUPPORTED_RATIOS} (ratios 4 and 128 are DeepSeek-V4, not V4.1)"
            )
    sources = (("kv_source_layer_ids", kv_sources), ("index_source_layer_ids", index_sources))
    for name, ids in sources:
        if list(ids) != sorted(set(ids)):
            raise ValueError(f"{name}: must be strictly increasing, got {list(ids)}")
        for i in ids:
            if not 0 <= i < n:
                raise ValueError(f"{name}: layer {i} is outside 0..{n - 1}")
            if ratios[i] == 0:
                raise ValueError(f"{name}: layer {i} is not a compressed layer (ratio 0)")
    for i in kv_sources:
        if i not in index_sources:
            raise ValueError(
                f"index_source_layer_ids: kv source layer {i} must also be an index "
                "source (it owns index K)"
            )
    for i, r in enumerate(ratios):
        for name, ids, what in (
            ("kv_source_layer_ids", kv_sources, "kv source"),
            ("index_source_layer_ids", index_sources, "index source"),
        ):
            if r and _nearest(ids, ratios, i, r) is None:
                raise ValueError(
                    f"{name}: layer {i} (ratio {r}) has no {what} of ratio {r} at or before it"
                )
    c = candidate_source
    if c >= 0 and (c >= n or c not in index_sources):
        raise ValueError(f"candidate_source_layer_id: layer {c} is not an index source")


def layer_roles(
    ratios: tuple[int, ...],
    kv_sources: tuple[int, ...],
    index_sources: tuple[int, ...],
    candidate_source: int = -1,
) -> tuple[LayerRole, ...]:
    """The role of every layer with these compress ratios (one per layer) and sources.

    Raises ValueError starting with the config field at fault when the wiring is inconsistent.
    """
    _check_wiring(ratios, kv_sources, index_sources, candidate_source)
    return tuple(
        _role(i, ratios, kv_sources, index_sources, candidate_source) for i in range(len(ratios))
    )


def _role(
    i: int,
    ratios: tuple[int, ...],
    kv_sources: tuple[int, ...],
    index_sources: tuple[int, ...],
    c: int,
) -> LayerRole:
    r = ratios[i]
    if r == 0:
        return LayerRole(i, 0, None, False, False, None, False, False)
    is_index = i in index_sources
    return LayerRole(
        layer=i,
        ratio=r,
        kv_source=_nearest(kv_sources, ratios, i, r),
        owns_compressor=i in kv_sources,
        index_source=is_index,
        topk_from=_nearest(index_sources, ratios, i, r),
        candidate_source=is_index and i == c,
        candidate_consumer=is_index and 0 <= c < i and ratios[c] == r,
    )
