"""Triton's Gluon dialect where this Triton has it, and what this package's Gluon kernels share:
the CTA-wide barrier across Triton versions and compiling for sm_90 without a GPU (tests)."""

from __future__ import annotations

import triton

try:  # Gluon ships with Triton ≥ 3.4; the module imports without a GPU
    from triton.experimental.gluon import language as gl

    # one CTA-wide barrier: `thread_barrier` in Triton 3.6 (the device), `barrier` from 3.7
    cta_barrier = getattr(gl, "thread_barrier", None) or gl.barrier
    HAVE_GLUON = True
except ImportError:  # pragma: no cover - older Triton
    HAVE_GLUON = False


def compile_sm90(
    kernel: object, types: list[str], options: dict[str, int], const: dict[str, int]
) -> object:
    """Compile a Gluon kernel for sm_90 without a GPU: `types` the signature of its leading
    non-constexpr arguments, `const` its constexprs, with the divisibility hints a real launch
    gives pointers and strides. Triton's compiled kernel."""
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    names = kernel.arg_names  # type: ignore[attr-defined]
    sig = dict(zip(names, types + ["constexpr"] * len(const)))
    hinted = [i for i, n in enumerate(names[: len(types)])
              if types[i].startswith("*") or n.startswith("stride")]  # fmt: skip
    attrs = {(i,): [["tt.divisibility", 16]] for i in hinted}
    return triton.compile(
        GluonASTSource(kernel, sig, constexprs=const, attrs=attrs),
        target=GPUTarget("cuda", 90, 32),
        options=options,
    )
