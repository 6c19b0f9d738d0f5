"""Compile every shipped configuration for sm_90a (no GPU needed) and read what it became:
wgmma (HGMMA) and TMA must be there, nothing may spill, shared memory must fit.

Runs in a subprocess: the tests themselves run the kernels through the
interpreter, and the sm_90a compiler needs the real JIT functions. conftest.py
starts it when the test is collected (``start``), with two compile workers, so it
runs beside the interpreter tests instead of after them, and moves this test to the
end of the session, where it waits for the check. Under pytest-xdist the first worker
to collect starts it and whichever runs this test waits for its result (a folder named
by the run's id).
"""

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

import pytest

_RUN: dict = {}


def _shared_dir() -> str | None:
    """Under pytest-xdist, a folder every worker of this run names alike: the first to
    create it runs the check, the others wait for its result there (one check per run)."""
    uid = os.environ.get("PYTEST_XDIST_TESTRUNUID")
    return os.path.join(tempfile.gettempdir(), f"codetta-sass-{uid}") if uid else None


_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _compile_env() -> dict:
    """The environment of a subprocess that compiles for sm_90a: the interpreter off (its
    JIT functions cannot be compiled), this checkout first on the path."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = _ROOT + os.pathsep + env.get("PYTHONPATH", "")
    return env


def start(workers: int = 1) -> None:
    """Start the sm_90a check in the background (once per run); its output and exit
    status go to files."""
    if _RUN:
        return
    shared = _shared_dir()
    if shared is None:
        folder = tempfile.mkdtemp(prefix="codetta-sass-")
    else:
        try:
            os.mkdir(shared)
        except FileExistsError:  # another worker runs it
            _RUN["dir"] = shared
            return
        folder = shared
    env = _compile_env()
    env["CODETTA_AOT_WORKERS"] = str(workers)
    # the exit status is written last (its file's presence says the check is over)
    # (the shipped picks and each mainloop's heaviest other candidate; every candidate with
    # CODETTA_SASS_EVERY=1: ~1.6x the kernels, ~5 CPU minutes more on a cold cache)
    scope = "" if os.environ.get("CODETTA_SASS_EVERY") == "1" else " --ci"
    check = f'"{sys.executable}" -m codetta.programs.sm90_check{scope}'
    cmd = f"{check} > out.txt 2>&1; echo $? > rc.tmp; mv rc.tmp rc"
    _RUN["dir"] = folder
    _RUN["proc"] = subprocess.Popen(["sh", "-c", cmd], cwd=folder, env=env, start_new_session=True)


def stop() -> None:
    """Kill the check this process started, with its compile workers, and leave a status
    saying so (a worker waiting for it fails at once instead of timing out)."""
    proc = _RUN.get("proc")
    if proc is not None and proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:  # (it ended meanwhile)
            pass
        proc.wait()
        rc = os.path.join(_RUN["dir"], "rc")
        if os.path.isdir(_RUN["dir"]) and not os.path.exists(rc):
            with open(rc, "w") as f:
                f.write("killed\n")


def finish(timeout: float) -> None:
    """Wait for the check this process started (at most ``timeout`` s, then stop it)."""
    try:
        _RUN["proc"].wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        stop()


def _wait(folder: str, timeout: float) -> tuple[int, str]:
    deadline = time.monotonic() + timeout
    rc = os.path.join(folder, "rc")
    while not os.path.exists(rc):
        if time.monotonic() > deadline:
            raise TimeoutError(f"the sm_90a check did not finish in {timeout:.0f} s")
        time.sleep(1.0)
    with open(rc) as f:
        status = f.read().strip()
    if not status.isdigit():
        raise RuntimeError(f"the sm_90a check was stopped ({status}) before it finished")
    with open(os.path.join(folder, "out.txt")) as g:
        text = g.read()
    shutil.rmtree(folder, ignore_errors=True)  # (read: no stale result for a later run to find)
    return int(status), text


@pytest.mark.slow
def test_sm90_sass():
    start(workers=os.cpu_count() or 1)  # (started at collection unless run on its own: then every core)
    try:
        rc, text = _wait(_RUN["dir"], timeout=1500)
    except TimeoutError:
        stop()
        raise
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


def test_wgmma_serialized_reading():
    """The sm_90a check's reading of a serialized wgmma pipeline in SASS: a
    WARPGROUP.ARRIVE before every HGMMA (as ptxas emitted for fp16 ce_logits, run 216),
    against one per group of HGMMA (the pipelined form)."""
    from codetta.kernels.aot import wgmma_serialized

    hgmma = "        /*0a10*/                   HGMMA.64x128x16.F32 R24, gdesc[UR4], R24 ;\n"
    arrive = "        /*0a00*/                   WARPGROUP.ARRIVE ;\n"
    depbar = "        /*0a20*/                   WARPGROUP.DEPBAR.LE gsb0, 0x0 ;\n"
    assert not wgmma_serialized(arrive + hgmma * 4 + depbar)
    assert wgmma_serialized((arrive + hgmma + depbar) * 4)
    assert not wgmma_serialized(arrive + hgmma + depbar)  # (one HGMMA: nothing to pipeline)


def test_serialized_wgmma_read_from_either_source():
    """The check reads a serialized wgmma pipeline from ptxas's report where it ran ptxas,
    from that report kept beside Triton's cache where the kernel came from the cache, and
    from the SASS where neither is there: each reading finds the flattened SwiGLU candidate
    serialized and the plain store not (a subprocess, without the interpreter:
    ``tests/sass_readings.py``)."""
    import json

    script = os.path.join(_ROOT, "tests", "sass_readings.py")
    env = _compile_env()
    run = subprocess.run([sys.executable, script], env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-4000:]
    found = json.loads(run.stdout.strip().splitlines()[-1])
    # (source, has a ptxas report, read as serialized)
    assert found["swiglu flattened"] == [["ptxas", True, True], ["kept", True, True], ["sass", False, True]]
    assert found["store"] == [["ptxas", True, False], ["kept", True, False], ["sass", False, False]]


def test_sincos_reductions_fused():
    """RoPE's sin/cos helpers compiled for sm_90a: every product of their reductions
    (x - j C, C the constant's three parts) is a fused multiply-add, so each stays exact
    past the interpreter's ~131k radians (numpy rounds the product; the GPU's
    ``test_sincos_long_positions`` checks the values to 2^22). Compiled in a subprocess,
    without the interpreter."""
    import json

    script = os.path.join(_ROOT, "tests", "sincos_ptx.py")
    env = _compile_env()
    run = subprocess.run([sys.executable, script], env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-4000:]
    found = json.loads(run.stdout.strip().splitlines()[-1])
    assert set(found) == {"polynomial", "approx"}
    for helper, consts in found.items():
        assert len(consts) == 3, (helper, consts)
        for c, instrs in consts.items():
            assert instrs == ["fma.rn.f32"], (helper, c, instrs)


def test_ci_scope_keeps_shipped_picks_and_the_heaviest_other(shipped_triton):
    """The CPU suite's sm_90a scope (``sm90_check --ci``): of each program's candidates on
    each mainloop, every config a shipped table runs and one other, the most accumulator per
    warp; every candidate without the flag."""
    from codetta import programs
    from codetta.kernels.aot import _runs_shipped, candidates
    from codetta.kernels.engines import PINGPONG, TRITON

    kept_total = every_total = shipped_seen = 0
    for name in programs.__all__:
        program = getattr(programs, name)
        for engine in (TRITON, PINGPONG):
            every = engine.candidates(program)
            assert candidates(program, engine) == every
            kept = candidates(program, engine, every=False)
            shipped = [c for c in every if _runs_shipped(program, c)]
            others = [c for c in kept if not _runs_shipped(program, c)]
            assert [c for c in kept if _runs_shipped(program, c)] == shipped
            assert len(others) == (1 if len(every) > len(shipped) else 0)
            per_warp = [x.block_m * x.block_n // x.num_warps for x in every if not _runs_shipped(program, x)]
            for c in others:
                assert c.block_m * c.block_n // c.num_warps == max(per_warp)
            kept_total += len(kept)
            every_total += len(every)
            shipped_seen += len(shipped)
    assert shipped_seen > 40  # (the shipped tables are read: a scope of nothing would pass above)
    assert kept_total < every_total
