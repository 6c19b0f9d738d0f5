"""``python -m codetta.programs.sm90_check``: compile every shipped program with every
candidate configuration of both mainloops for sm_90a (bf16; in fp16 the shipped
picks), without a GPU, and read the PTX, SASS and resource use
(wgmma, TMA, the ping-pong kernels' and shipped picks' wgmma not serialized by ptxas, no
spills, shared memory fits); and the row passes of the backward (RoPE's, the norms', the
embedding gradient's, the loss's) and the row finish at their default launches (no
spills). ``--ci``: of each mainloop's candidates only the shipped picks and the heaviest
other one (``aot.candidates``; about two thirds of the kernels): the CPU suite runs that
(tests/test_sass.py; ``CODETTA_SASS_EVERY=1`` there for every candidate).
"""

import os
import sys

import triton

from .. import programs
from ..kernels import reductions
from ..kernels.aot import check_all, compile_kernel_sm90, inspect
from . import ce, embedding, norm_rows, rope


def check_row_passes() -> list[str]:
    """The row passes of the backward (RoPE's inverse rotation, the q/k-norm backward, the
    RMSNorm backward, the embedding gradient's, the loss's gradient pass) and the reductions'
    row finish at their default launches, bf16: one line per spill found."""
    problems = []
    jobs = rope.row_pass_jobs() + norm_rows.row_pass_jobs() + embedding.row_pass_jobs()
    jobs += ce.row_pass_jobs() + reductions.row_pass_jobs()
    for label, fn, types, consts, warps in jobs:
        sig = {a: types.get(a, "constexpr") for a in fn.arg_names}  # (the kernel's argument order)
        rep = inspect(compile_kernel_sm90(fn, sig, consts, warps), label)
        found = [p for p in rep.problems() if "spills" in p]
        print(f"{label}: {rep.n_regs} regs, {'; '.join(found) or 'ok'}", flush=True)
        problems += [f"{label}: {p}" for p in found]
    return problems


if __name__ == "__main__":
    if triton.knobs.runtime.interpret:
        sys.exit("unset TRITON_INTERPRET: the sm_90a compiler needs the real JIT functions")
    workers = int(os.environ.get("CODETTA_AOT_WORKERS", "0")) or None  # default: one per CPU
    every = "--ci" not in sys.argv[1:]
    bad = check_all([getattr(programs, name) for name in programs.__all__], workers=workers, every=every)
    bad += check_row_passes()
    ok = "all sm_90a kernels: HGMMA + TMA, checked wgmma pipelined, no spills, shared memory fits"
    print("\n".join(bad) if bad else ok)
    sys.exit(1 if bad else 0)
