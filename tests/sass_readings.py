"""As a script (no GPU, no interpreter): two kernels compiled for sm_90a into a new Triton
cache, each read three times for a serialized wgmma pipeline: from ptxas's own report (the
first compile runs ptxas), from that report as kept beside the cache (the second comes
from the cache), and from the SASS (the third, with the kept report removed): the
flattened SwiGLU candidate that ptxas serializes (its C7515) and the plain store's first
candidate, which it does not. Prints one JSON line for test_sass.py's
``test_serialized_wgmma_read_from_either_source``."""

import atexit
import json
import os
import shutil
import tempfile

os.environ["TRITON_CACHE_DIR"] = tempfile.mkdtemp(prefix="codetta-sass-readings-")
atexit.register(shutil.rmtree, os.environ["TRITON_CACHE_DIR"], True)  # (3 MB a run, left behind before)

from codetta import programs  # noqa: E402
from codetta.kernels.aot import _kept_log, compile_sm90, inspect  # noqa: E402
from codetta.kernels.configs import Config  # noqa: E402
from codetta.kernels.engines import TRITON  # noqa: E402
from codetta.kernels.program import STORE  # noqa: E402

SERIALIZED = Config(block_m=128, block_n=128, num_stages=3, num_warps=8, epi_split=2, flatten=True)
found = {}
for label, program, cfg in (("swiglu flattened", programs.SWIGLU, SERIALIZED),
                            ("store", STORE, TRITON.candidates(STORE)[0])):  # fmt: skip
    reads = []
    for source in ("ptxas", "kept", "sass"):
        kernel = compile_sm90(program, cfg)
        reads.append((source, kernel.ptxas_log is not None, inspect(kernel, label).wgmma_serialized))
        if source == "kept":
            _kept_log(kernel.asm["cubin"]).unlink()
    found[label] = reads
print(json.dumps(found))
