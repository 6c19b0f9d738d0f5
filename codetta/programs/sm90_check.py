"""``python -m codetta.programs.sm90_check``: compile every shipped program with every
candidate configuration of both mainloops for sm_90a, without a GPU, and read the
PTX and resource use (wgmma, TMA, no spills, shared memory fits). CI runs it (tests/test_sass.py).
"""

import os
import sys

from .. import programs
from ..kernels.aot import check_all

if __name__ == "__main__":
    if os.environ.get("TRITON_INTERPRET") == "1":
        sys.exit("unset TRITON_INTERPRET: the sm_90a compiler needs the real JIT functions")
    workers = int(os.environ.get("CODETTA_AOT_WORKERS", "0")) or None  # default: one per CPU
    bad = check_all([getattr(programs, name) for name in programs.__all__], workers=workers)
    print("\n".join(bad) if bad else "all sm_90a kernels: HGMMA + TMA, no spills, shared memory fits")
    sys.exit(1 if bad else 0)
