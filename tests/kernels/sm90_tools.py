"""The CUDA binary tools that ship with Triton (or are on PATH), for the sm_90 compile tests:
ptxas to assemble a kernel's PTX without a GPU, cuobjdump to read its SASS."""

from __future__ import annotations

import shutil
import subprocess
import tempfile
from pathlib import Path


def tool(name: str) -> str | None:
    """Triton's bundled `name` (ptxas, cuobjdump), else one on PATH, else None."""
    import triton

    bundled = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / name
    return str(bundled) if bundled.exists() else shutil.which(name)


def assemble_sm90(ptx: str, exe: str, verbose: bool = False) -> subprocess.CompletedProcess[str]:
    """ptxas (`exe`) on `ptx` for sm_90a; its stderr holds `-v`'s report when `verbose`."""
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "k.ptx"
        src.write_text(ptx)
        flags = ["-v"] if verbose else []
        return subprocess.run(
            [exe, *flags, "--gpu-name=sm_90a", str(src), "-o", str(Path(tmp) / "k.cubin")],
            capture_output=True,
            text=True,
        )


def sass_lines(cubin: bytes, exe: str) -> list[str]:
    """cuobjdump (`exe`) -sass of a cubin, line by line."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "k.cubin"
        path.write_bytes(cubin)
        res = subprocess.run([exe, "-sass", str(path)], capture_output=True, text=True, check=True)
    return res.stdout.splitlines()
