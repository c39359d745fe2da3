"""cos/sin, exp, rsqrt and division in fp32 as the GPU's libdevice does them exactly (PRECISE),
or as `tl.math` does them in Triton's CPU interpreter, which has no libdevice."""

from __future__ import annotations

import triton
import triton.language as tl

from dsv4cp.kernels._triton import interpreting

if not interpreting():
    from triton.language.extra import libdevice
else:  # the interpreter has no libdevice; tl.math stands in for it there.
    libdevice = None


@triton.jit
def cos_sin(x, PRECISE: tl.constexpr):
    """cos and sin of fp32 angles. On the GPU the angle is first reduced modulo 2π in fp64, so
    libdevice always takes its fast path (|x| > 105615 would take the slow Payne-Hanek one,
    through local memory, for the large positions of long contexts)."""
    if PRECISE:
        x64 = x.to(tl.float64)
        k = tl.floor(x64 * 0.15915494309189535 + 0.5)
        r = (x64 - k * 6.283185307179586).to(tl.float32)
        return libdevice.cos(r), libdevice.sin(r)
    else:
        return tl.cos(x), tl.sin(x)


@triton.jit
def exp(x, PRECISE: tl.constexpr):
    if PRECISE:
        return libdevice.exp(x)
    else:
        return tl.exp(x)


@triton.jit
def rsqrt(x, PRECISE: tl.constexpr):
    if PRECISE:
        return libdevice.rsqrt(x)
    else:
        return 1.0 / tl.sqrt(x)


@triton.jit
def div(a, b, PRECISE: tl.constexpr):
    """IEEE fp32 division (the GPU's `/` may be approximate; the interpreter's is IEEE)."""
    if PRECISE:
        return libdevice.div_rn(a, b)
    else:
        return a / b
