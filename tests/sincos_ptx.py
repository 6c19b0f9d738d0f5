"""RoPE's sin/cos helpers in a kernel (``sincos_kernel``: test_programs.py runs it); as a
script, compiled for sm_90a (no GPU needed), each reduction constant's PTX instructions
printed, for test_sass.py's ``test_sincos_reductions_fused`` (run without the
interpreter, whose JIT functions cannot be compiled)."""

import json
import struct

import triton
import triton.language as tl

from codetta.kernels import primitives as P
from codetta.kernels.aot import compile_kernel_sm90

# each helper's three-part reduction constants (``P.sincos``: pi / 2; ``sincos_approx``: 2 pi)
CONSTANTS = {
    False: (1.5703125, 4.837512969970703125e-4, 7.549789954891882e-8),
    True: (6.28125, 1.934051513671875e-3, 1.2556659e-6),
}


@triton.jit
def sincos_kernel(x_ptr, out_ptr, N, APPROX: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = offs < N
    x = tl.load(x_ptr + offs, mask=m, other=0.0)
    if APPROX:
        s, c = P.sincos_approx(x)
    else:
        s, c = P.sincos(x)
    tl.store(out_ptr + offs, s, mask=m)
    tl.store(out_ptr + N + offs, c, mask=m)


def _hex(c: float) -> str:
    """A float32 constant as PTX writes it (0fXXXXXXXX)."""
    return f"0f{struct.unpack('<I', struct.pack('<f', c))[0]:08X}"


def main():
    sig = {"x_ptr": "*fp32", "out_ptr": "*fp32", "N": "i32", "APPROX": "constexpr", "BLOCK": "constexpr"}
    found = {}
    for approx, consts in CONSTANTS.items():
        ptx = compile_kernel_sm90(sincos_kernel, sig, {"APPROX": approx, "BLOCK": 256}, 4).asm["ptx"]
        # (each constant's instructions: "fma.rn.f32" alone where every product is fused)
        found["approx" if approx else "polynomial"] = {
            repr(c): sorted({ln.split()[0] for ln in ptx.splitlines() if _hex(c) in ln or _hex(-c) in ln})
            for c in consts
        }
    print(json.dumps(found))


if __name__ == "__main__":
    main()
