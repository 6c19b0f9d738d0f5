"""``python -m codetta.programs.sm90_check``: compile every shipped program with every
candidate configuration of both mainloops for sm_90a, without a GPU, and read the
PTX and resource use (wgmma, TMA, no spills, shared memory fits); and the RoPE
backward row passes at their default launches (no spills). CI runs it (tests/test_sass.py).
"""

import os
import sys

from .. import programs
from ..kernels.aot import check_all, compile_kernel_sm90, inspect
from . import rope


def check_row_passes() -> list[str]:
    """The inverse rotation and the q/k-norm backward, bf16, every head dim and both
    RoPE conventions, at their default launches: one line per spill found."""
    problems = []
    for name, fn, types, launch in rope.row_pass_kernels():
        for hd in rope.HEAD_DIMS:
            for pairs in (False, True):
                block_m, warps = launch(hd // 2)
                consts = {"HALF": hd // 2, "BLOCK_M": block_m, "PAIRS": pairs}
                # (the kernel's own argument order)
                sig = {a: types.get(a, "constexpr") for a in fn.arg_names}
                label = f"{name} head_dim {hd}{' pairs' if pairs else ''} {block_m} rows {warps} warps"
                rep = inspect(compile_kernel_sm90(fn, sig, consts, warps), label)
                found = [p for p in rep.problems() if "spills" in p]
                print(f"{label}: {rep.n_regs} regs, {'; '.join(found) or 'ok'}", flush=True)
                problems += [f"{label}: {p}" for p in found]
    return problems


if __name__ == "__main__":
    if os.environ.get("TRITON_INTERPRET") == "1":
        sys.exit("unset TRITON_INTERPRET: the sm_90a compiler needs the real JIT functions")
    workers = int(os.environ.get("CODETTA_AOT_WORKERS", "0")) or None  # default: one per CPU
    bad = check_all([getattr(programs, name) for name in programs.__all__], workers=workers)
    bad += check_row_passes()
    print("\n".join(bad) if bad else "all sm_90a kernels: HGMMA + TMA, no spills, shared memory fits")
    sys.exit(1 if bad else 0)
