"""Load a released-format DeepSeek-V4.1 checkpoint into a `DeepseekV41Model` (text only).

What is read: every tensor the model holds (`DeepseekV41Model.checkpoint_weights`: embedding,
final norm, head, and per block its norms, hyper-connections, attention, MoE and Engram
projections), and each Engram layer's table, attached as a read-only memmap of its shard
(`CheckpointReader.memmap`: only looked-up rows are ever read), hashed through the checkpoint's
tokenizer.json (loaded right after the name check, before any weight: a missing, corrupt or
mismatched tokenizer is a `CheckpointError` naming the file; the tables' shapes are checked
against the config then too). What is skipped, by name and on
purpose, with one log line: the vision tower (`vision.*`, `aligner.*`, `image_*`, and each MoE
gate's `gate.bias_vl`, the routing bias of image tokens) and the DSpark draft layers (`mtp.*`);
with expert parallelism (docs/ep.md) the routed experts other ranks hold
(`layers.L.ffn.experts.E.*` outside this rank's `MoE.experts`): never read, so a rank's host and
device memory hold only its n_routed_experts / N experts.
Any other name the model does not expect, or any name it expects that the checkpoint lacks, is
one `CheckpointError` listing them all (unexpected ones with their shard).

How: per group (the top-level tensors, then each block) `checkpoint.load_into` reads and checks
every tensor (kind dtype, scale layout, shape) before writing any; an fp8 weight whose model
tensor is not fp8 (today's dense attention projections, `wo_a`) is dequantized with its `.scale`
(the scale is then consumed); a float tensor stored narrower than the model holds it (bf16 into
an fp32 model) is widened exactly. Every loaded tensor is checked finite (NaN/inf, fp8 NaN codes,
e8m0 0xFF): an error names the tensor and its shard. A failed load leaves the model unusable;
`DeepseekV41Model.from_checkpoint` then returns nothing. One progress line per block. After the
last tensor, `$DSV4CP_KEEP_BF16_WEIGHTS` (attention / all; default off, checked before anything
is read) has the model hold bf16 copies of those fp8 weights (`keep_dequantized_weights`).
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import torch
from torch import Tensor

from dsv4cp.checkpoint import CheckpointError, CheckpointReader, load_into, tensor_kind
from dsv4cp.checkpoint.formats import scale_name
from dsv4cp.checkpoint.header import safetensors_dtype, torch_dtype
from dsv4cp.checkpoint.validate import check_quantized_weight
from dsv4cp.layers.block import DeepseekV41Block
from dsv4cp.layers.engram import TABLE_NAMES, Engram
from dsv4cp.layers.linear import KEEP_BF16_ENV, KeptWeights, kept_weights_scope
from dsv4cp.layers.moe import MoE
from dsv4cp.ops.engram import RowSource
from dsv4cp.ops.engram_hash import NgramHasher

logger = logging.getLogger("dsv4cp.loader")

# (what, why, name pattern) of the tensors text prefill does not read.
SKIPPED = (  # first match wins: a DSpark stage's gate.bias_vl counts as DSpark
    ("DSpark", "no DSpark draft layers", re.compile(r"^mtp\.")),
    ("vision", "no vision tower", re.compile(r"^(vision\.|aligner\.|image_)|\.gate\.bias_vl$")),
)
TOKENIZER_FILE = "tokenizer.json"
_MAX_LISTED = 20


class DeepseekV41Model(Protocol):
    """What the loader needs of `dsv4cp.model.DeepseekV41Model` (which imports this module)."""

    config: Any

    @property
    def blocks(self) -> list[DeepseekV41Block]: ...

    @property
    def engram_layers(self) -> list[Engram]: ...

    def checkpoint_weights(self) -> dict[str, Tensor]: ...

    def keep_dequantized_weights(self, scope: KeptWeights = "attention") -> int: ...

    def attach_engram(
        self, hasher: NgramHasher, tables: dict[int, tuple[RowSource, RowSource]]
    ) -> None: ...


@dataclass
class LoadReport:
    """What `load_checkpoint` did: counts per kind of handling, and the skipped names."""

    loaded: int = 0  # tensors copied into the model (scales consumed by dequantization excluded)
    dequantized: list[str] = field(default_factory=list)
    widened: list[str] = field(default_factory=list)
    engram_tables: list[str] = field(default_factory=list)
    skipped: dict[str, list[str]] = field(default_factory=dict)
    kept_bf16_bytes: int = 0  # bf16 copies of fp8 weights held ($DSV4CP_KEEP_BF16_WEIGHTS)
    seconds: float = 0.0


def skipped_kind(name: str) -> str | None:
    """'vision' / 'DSpark' for a tensor text prefill skips on purpose, else None."""
    for kind, _, pattern in SKIPPED:
        if pattern.search(name):
            return kind
    return None


def engram_table_names(model: DeepseekV41Model) -> dict[int, tuple[str, str]]:
    """Engram layer → (table codes name, table scales name)."""
    weight, scale = TABLE_NAMES
    return {
        e.layer_id: (f"layers.{e.layer_id}.engram.{weight}", f"layers.{e.layer_id}.engram.{scale}")
        for e in model.engram_layers
    }


def _dense_from_fp8(name: str, slot: Tensor) -> bool:
    """The release stores `name` fp8 (with a `.scale`) but the model holds it dense: it loads
    dequantized and its scale is read with it."""
    return tensor_kind(name) == "fp8" and slot.dtype != torch.float8_e4m3fn


def expected_names(model: DeepseekV41Model) -> set[str]:
    """Every text tensor name the loader reads: the model's own tensors, the `.scale` of each
    fp8 weight it holds dequantized, and the Engram tables (skipped names excluded)."""
    names = set()
    for name, slot in model.checkpoint_weights().items():
        names.add(name)
        if _dense_from_fp8(name, slot):
            names.add(scale_name(name))
    for pair in engram_table_names(model).values():
        names.update(pair)
    return names


_EXPERT = re.compile(r"^layers\.(\d+)\.ffn\.experts\.(\d+)\.")
EP_SKIPPED = "other EP ranks'"


def foreign_expert(model: DeepseekV41Model, name: str) -> bool:
    """`name` is a routed expert's tensor that another expert-parallel rank holds (an expert
    number past the layer's count stays unexpected)."""
    m = _EXPERT.match(name)
    if m is None:
        return False
    layer, expert = int(m.group(1)), int(m.group(2))
    if not 0 <= layer < len(model.blocks):
        return False
    ffn = model.blocks[layer].ffn
    if not isinstance(ffn, MoE):
        return False
    return expert not in ffn.experts and 0 <= expert < ffn.spec.n_routed_experts


def _check_names(reader: CheckpointReader, model: DeepseekV41Model) -> dict[str, list[str]]:
    skipped: dict[str, list[str]] = {kind: [] for kind, _, _ in SKIPPED}
    skipped[EP_SKIPPED] = []
    text = set()
    for n in reader.names():
        kind = skipped_kind(n)
        if kind is None and foreign_expert(model, n):
            kind = EP_SKIPPED
        if kind is None:
            text.add(n)
        else:
            skipped[kind].append(n)
    if not skipped[EP_SKIPPED]:
        del skipped[EP_SKIPPED]  # no expert parallelism
    want = expected_names(model)
    missing, unexpected = sorted(want - text), sorted(text - want)
    if missing or unexpected:
        lines = [f"{reader.root}: the checkpoint does not match the model's text tensors"]
        if missing:
            lines.append(f"  missing ({len(missing)}): " + ", ".join(missing[:_MAX_LISTED]))
        for n in unexpected[:_MAX_LISTED]:
            lines.append(f"  unexpected: {n!r} in {reader.file_of(n)}")
        if len(unexpected) > _MAX_LISTED:
            lines.append(f"  … and {len(unexpected) - _MAX_LISTED} more unexpected")
        raise CheckpointError("\n".join(lines))
    return skipped


def nonfinite(t: Tensor) -> int:
    """Elements of t that are NaN or ±inf (fp8 e4m3 NaN codes, e8m0 0xFF); 0 for integers."""
    if t.dtype in (torch.float8_e4m3fn, torch.float8_e4m3fnuz):
        return int(((t.view(torch.uint8) & 0x7F) == 0x7F).sum())
    if t.dtype == torch.float8_e8m0fnu:
        return int((t.view(torch.uint8) == 0xFF).sum())
    if t.is_floating_point():
        return int((~torch.isfinite(t)).sum())
    return 0


def _load_group(reader: CheckpointReader, slots: dict[str, Tensor], report: LoadReport) -> None:
    """Read, check and copy one group of tensors (nothing written unless all of it passed)."""
    direct: dict[str, Tensor] = {}
    staged: dict[str, Tensor] = {}  # stored narrower than the model: read as stored, widened
    dequant = []
    for name, slot in slots.items():
        stored = reader.spec(name)
        if _dense_from_fp8(name, slot):
            dequant.append(name)
            direct[name] = slot
        elif stored.dtype == safetensors_dtype(slot.dtype):
            direct[name] = slot
        else:
            have = torch_dtype(stored.dtype)
            if not (
                have.is_floating_point
                and slot.dtype.is_floating_point
                and have.itemsize < slot.dtype.itemsize
                and tensor_kind(name) in ("bf16", "f32", None)
            ):
                raise CheckpointError(
                    f"{stored.file}: tensor {name!r} is {stored.dtype}, the model holds "
                    f"{safetensors_dtype(slot.dtype)}"
                )
            staged[name] = torch.empty(slot.shape, dtype=have, device=slot.device)
    load_into({**direct, **staged}, reader, list(direct) + list(staged), dequantize=dequant)
    for name in list(direct) + list(staged):
        t = staged.get(name, direct.get(name))
        assert t is not None
        bad = nonfinite(t)
        if bad:
            raise CheckpointError(
                f"{reader.file_of(name)}: tensor {name!r} has {bad} non-finite value(s)"
            )
    with torch.no_grad():
        for name, t in staged.items():
            slots[name].copy_(t.to(slots[name].dtype))
    report.loaded += len(slots)
    report.dequantized += dequant
    report.widened += list(staged)


def _engram_tables(
    reader: CheckpointReader, model: DeepseekV41Model, report: LoadReport
) -> dict[int, tuple[RowSource, RowSource]]:
    """Each Engram layer's table and scales as shard memmaps, checked: fp8 rows with their
    scales, of the shape the config gives the layer (engram_num_embeddings, engram_head_dim)."""
    layers = {e.layer_id: e for e in model.engram_layers}
    tables: dict[int, tuple[RowSource, RowSource]] = {}
    for layer, (weight, scale) in engram_table_names(model).items():
        check_quantized_weight(reader, weight, "fp8_rows")
        spec, want = reader.spec(weight), (layers[layer].num_rows, layers[layer].head_dim)
        if spec.shape != want:
            raise CheckpointError(
                f"{spec.file}: Engram table {weight!r} has shape {list(spec.shape)}, layer "
                f"{layer} of the config needs {list(want)} (engram_num_embeddings, "
                "engram_head_dim)"
            )
        tables[layer] = (reader.memmap(weight), reader.memmap(scale))
        report.engram_tables += [weight, scale]
    return tables


def _hasher(root: Path, model: DeepseekV41Model) -> NgramHasher:
    """The Engram hasher from the checkpoint's tokenizer.json; a missing or unreadable file, or
    one that does not fit the config, is a CheckpointError naming it."""
    from tokenizers import Tokenizer

    file = root / TOKENIZER_FILE
    if not file.is_file():
        raise CheckpointError(f"{file}: Engram layers hash token ids through the tokenizer")
    try:
        tokenizer = Tokenizer.from_file(str(file))
    except Exception as e:  # the tokenizers library raises a bare Exception
        detail = " ".join(str(e).split())
        raise CheckpointError(f"{file}: cannot load the tokenizer ({detail})") from None
    try:
        return NgramHasher.build(model.config, tokenizer)
    except ValueError as e:
        raise CheckpointError(f"{file}: {e}") from None


def load_checkpoint(
    model: DeepseekV41Model,
    path: str | Path,
    *,
    progress: Callable[[str], None] | None = None,
) -> LoadReport:
    """Load the checkpoint at `path` into `model` (see the module docstring); `progress` gets
    one line per block (default: the `dsv4cp.loader` logger at INFO)."""
    say = progress or logger.info
    scope = kept_weights_scope()  # a bad value is refused before anything is read
    t0 = time.perf_counter()
    path = Path(path)
    report = LoadReport()
    with CheckpointReader(path) as reader:
        report.skipped = _check_names(reader, model)
        whys = [(kind, why) for kind, why, _ in SKIPPED]
        whys.append((EP_SKIPPED, "expert parallelism: other ranks hold them"))
        parts = [
            f"{len(report.skipped[kind])} {kind} tensors ({why})"
            for kind, why in whys
            if report.skipped.get(kind)
        ]
        if parts:
            say(f"dsv4cp: skipping {' and '.join(parts)}: text prefill does not read them")
        # the tokenizer before any weight: a bad tokenizer.json is found in seconds, not after
        # every block has loaded
        hasher = _hasher(reader.root, model) if model.engram_layers else None
        # the tables are checked before any weight too (memmaps: nothing is read here)
        tables = _engram_tables(reader, model, report) if hasher is not None else {}
        slots = model.checkpoint_weights()
        top = {n: slots[n] for n in ("embed.weight", "norm.weight", "head.weight")}
        _load_group(reader, top, report)
        n_blocks = len(model.blocks)
        for block in model.blocks:
            prefix = f"layers.{block.layer}."
            _load_group(reader, block.checkpoint_slots(prefix), report)
            say(
                f"dsv4cp: loaded block {block.layer + 1}/{n_blocks} "
                f"({report.loaded} tensors, {time.perf_counter() - t0:.1f} s)"
            )
        if hasher is not None:
            model.attach_engram(hasher, tables)
    if scope != "off":
        report.kept_bf16_bytes = model.keep_dequantized_weights(scope)
        say(
            f"dsv4cp: {KEEP_BF16_ENV}={scope}: holding bf16 copies of fp8 weights, "
            f"{report.kept_bf16_bytes / 2**30:.2f} GiB"
        )
    report.seconds = time.perf_counter() - t0
    return report
