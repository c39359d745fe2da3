"""Export a servable tiny dsv4cp checkpoint: weights, config, a local tokenizer, generation config.

The tokenizer is byte-level BPE built here without any hub access: ids 0..255 are the 256 bytes,
then three special tokens, then fixed merges (space+letter, then letter pairs by English letter
frequency) up to exactly `vocab_size`, so every id the model can emit decodes. No BOS is added
automatically: text and token ids map one to one between SGLang and dsv4cp.
"""

from __future__ import annotations

import json
import os
import shutil
import stat
import tempfile
from pathlib import Path
from typing import Any

from dsv4cp.config import DeepseekV41Config

BOS, EOS, PAD = "<|begin_of_text|>", "<|end_of_text|>", "<|pad|>"
SPECIALS = (BOS, EOS, PAD)
_LETTERS = "etaoinshrdlcumwfgypbvkjxqz"
# What export_tiny writes besides the weights (`model.WEIGHTS_FILE`), in the order they are
# moved into place: config.json last, so a directory with a config has the rest.
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
_OTHER_FILES = (*_TOKENIZER_FILES, "generation_config.json", "config.json")


def _byte_alphabet() -> list[str]:
    """The 256 byte-level symbols in byte order (GPT-2's bytes→unicode map)."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    out, extra = {}, 0
    for b in range(256):
        if b in keep:
            out[b] = chr(b)
        else:
            out[b] = chr(256 + extra)
            extra += 1
    return [out[b] for b in range(256)]


def _merges(n: int) -> list[tuple[str, str]]:
    space = _byte_alphabet()[ord(" ")]
    pairs = [(space, c) for c in _LETTERS] + [(a, b) for a in _LETTERS for b in _LETTERS]
    if n > len(pairs):
        raise ValueError(f"tokenizer: at most {len(pairs) + 259} ids, asked for {n + 259}")
    return pairs[:n]


def build_tokenizer(vocab_size: int) -> Any:
    """A `tokenizers.Tokenizer` with exactly `vocab_size` ids (>= 259)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    if vocab_size < 256 + len(SPECIALS):
        need = 256 + len(SPECIALS)
        raise ValueError(f"tokenizer: vocab_size must be >= {need}, got {vocab_size}")
    alphabet = _byte_alphabet()
    vocab = {s: i for i, s in enumerate(alphabet)}
    for s in SPECIALS:
        vocab[s] = len(vocab)
    merges = _merges(vocab_size - len(vocab))
    for a, b in merges:
        vocab[a + b] = len(vocab)
    assert len(vocab) == vocab_size
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(list(SPECIALS))
    return tok


def token_ids(vocab_size: int) -> dict[str, int]:
    return {f"{n}_token_id": 256 + i for i, n in enumerate(("bos", "eos", "pad"))}


def write_tokenizer(path: str | os.PathLike[str], vocab_size: int, model_max_length: int) -> None:
    path = Path(path)
    build_tokenizer(vocab_size).save(str(path / "tokenizer.json"))
    tok_cfg = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS,
        "eos_token": EOS,
        "pad_token": PAD,
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": model_max_length,
        "chat_template": (
            "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}assistant: {% endif %}"
        ),
    }
    (path / "tokenizer_config.json").write_text(json.dumps(tok_cfg, indent=2) + "\n")
    special = {"bos_token": BOS, "eos_token": EOS, "pad_token": PAD}
    (path / "special_tokens_map.json").write_text(json.dumps(special, indent=2) + "\n")


def serving_config(hf: dict, config: DeepseekV41Config, dtype: str) -> dict:
    """An export's HF config (`save_pretrained`'s: the dsv4cp model type) plus what a server
    needs: dtype, token ids."""
    out = dict(hf)
    out["torch_dtype"] = dtype
    out.update(token_ids(config.vocab_size))
    return out


def export_tiny(
    path: str | os.PathLike[str],
    seed: int = 0,
    *,
    config: DeepseekV41Config | None = None,
    model_max_length: int = 4096,
) -> Path:
    """Write a servable tiny checkpoint (fp32 weights) to `path` and return it."""
    import torch

    from dsv4cp.model import DeepseekV41Model

    config = config or DeepseekV41Config.tiny()
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    blocked = blocked_outputs(path)
    if blocked:
        raise ValueError(f"export_tiny: {blocked[0]} exists and is not a file")
    model = DeepseekV41Model(config, dtype=torch.float32, device="cpu", seed=seed)
    # Everything is written into a scratch directory inside `path` (same file system), then
    # renamed into place: a failure while writing leaves `path` as it was.
    scratch = Path(tempfile.mkdtemp(prefix=".export-tiny-", dir=path))
    try:
        model.save_pretrained(scratch)
        cfg_path = scratch / "config.json"
        hf = serving_config(json.loads(cfg_path.read_text()), config, "float32")
        cfg_path.write_text(json.dumps(hf, indent=2) + "\n")
        write_tokenizer(scratch, config.vocab_size, model_max_length)
        gen = {**token_ids(config.vocab_size), "_from_model_config": False}
        (scratch / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")
        umask = os.umask(0)
        os.umask(umask)
        for name in output_names():
            # the mode of a file created here (safetensors writes the weights 0600: a server
            # running as another user could read config.json but not model.safetensors)
            os.chmod(scratch / name, 0o666 & ~umask)
            os.replace(scratch / name, path / name)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return path


def output_names() -> tuple[str, ...]:
    """The files export_tiny writes into its directory, in the order they are moved there."""
    from dsv4cp.model import WEIGHTS_FILE

    return (WEIGHTS_FILE, *_OTHER_FILES)


def blocked_outputs(path: Path) -> list[Path]:
    """Output paths in `path` that exist and are neither a file nor a link (a directory, a fifo,
    …): a rename onto them fails. A link is replaced, not written through."""
    out = []
    for name in output_names():
        try:
            mode = (path / name).lstat().st_mode
        except FileNotFoundError:
            continue
        if not (stat.S_ISREG(mode) or stat.S_ISLNK(mode)):
            out.append(path / name)
    return out
