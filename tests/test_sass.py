"""Compile every shipped configuration for sm_90a (no GPU needed) and read the SASS:
wgmma (HGMMA) and TMA must be there, nothing may spill, shared memory must fit.

Runs in a subprocess: the tests themselves run the kernels through the
interpreter, and the sm_90a compiler needs the real JIT functions.
"""

import os
import subprocess
import sys

import pytest


@pytest.mark.slow
def test_sm90_sass():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.run(
        [sys.executable, "-m", "codetta.programs.sm90_check"],
        env=env,
        capture_output=True,
        text=True,
        timeout=1200,
    )
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-4000:]
    assert "all sm_90a kernels" in proc.stdout
