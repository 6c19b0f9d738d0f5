"""Compile every shipped configuration for sm_90a (no GPU needed) and read what it became:
wgmma (HGMMA) and TMA must be there, nothing may spill, shared memory must fit.

Runs in a subprocess: the tests themselves run the kernels through the
interpreter, and the sm_90a compiler needs the real JIT functions. conftest.py
starts it when the test is collected (``start``), with two compile workers, so it
runs beside the interpreter tests instead of after them, and moves this test to the
end of the session, where it waits for the check.
"""

import os
import subprocess
import sys
import tempfile

import pytest

_RUN: dict = {}


def start(workers: int = 1) -> None:
    """Start the sm_90a check in the background (once); its output goes to a temporary file."""
    if _RUN:
        return
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    env["CODETTA_AOT_WORKERS"] = str(workers)
    out = tempfile.TemporaryFile(mode="w+")
    _RUN["out"] = out
    _RUN["proc"] = subprocess.Popen(
        [sys.executable, "-m", "codetta.programs.sm90_check"], env=env, stdout=out, stderr=subprocess.STDOUT
    )


@pytest.mark.slow
def test_sm90_sass():
    start(workers=os.cpu_count() or 1)  # (not started at collection: run alone, use every core)
    proc, out = _RUN["proc"], _RUN["out"]
    try:
        rc = proc.wait(timeout=1500)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise
    out.seek(0)
    text = out.read()
    out.close()
    assert rc == 0, text[-10000:]
    assert "all sm_90a kernels" in text


def test_ptx_features():
    """The check reads wgmma and TMA from the PTX: a Hopper kernel's lines are found, an
    Ampere-style one's (mma.sync, plain loads, cp.async without tensor maps) are not."""
    from codetta.kernels.aot import ptx_features

    hopper = """
    @%p15 cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%r1], [%rd2], [%r5];
    wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {%f1, %f2}, %rd6, %rd7, p, 1, 1, 0, 1;
    @%p16 cp.async.bulk.tensor.2d.global.shared::cta.bulk_group [%rd8, {%r9, %r10}], [%r11];
    """
    ampere = """
    mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%f1, %f2, %f3, %f4}, {%r1, %r2}, {%r3}, {%f5};
    cp.async.cg.shared.global [%r1], [%rd2], 16;
    ld.global.v4.b32 {%r5, %r6, %r7, %r8}, [%rd9];
    """
    assert ptx_features(hopper) == (True, True, True)
    assert ptx_features(ampere) == (False, False, False)
