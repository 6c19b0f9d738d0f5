"""Test setup: the real kernels run through the Triton interpreter on CPU.

TRITON_INTERPRET must be set before triton decorates the kernels, so it is set
here, before any test module imports codetta. On a machine with CUDA the same
tests run on the GPU in bf16 at larger shapes.
"""

import os
import sys
import zlib

import pytest
import torch

ON_GPU = torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1"
if not ON_GPU:
    os.environ["TRITON_INTERPRET"] = "1"
    import interpreter_speed

    interpreter_speed.install()  # (the interpreter's per-helper re-patching skipped: its docstring)
    # the cores shared out between the test processes: torch's default, a thread per core in
    # every worker, oversubscribes them, and OpenMP's waiting threads spin (test_hf on 2
    # workers and 2 cores: 10-15 % less wall and CPU time this way, NOTES.md section "Session 56")
    torch.set_num_threads(
        max(1, torch.get_num_threads() // int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")))
    )
# tests pin configurations where it matters; tuning every test shape would be slow
os.environ.setdefault("CODETTA_AUTOTUNE", "0")


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a CUDA GPU")
    config.addinivalue_line("markers", "slow: compiles many kernels")


@pytest.hookimpl(trylast=True)  # (after -k / -m deselection: start the check only if its test runs)
def pytest_collection_modifyitems(config, items):
    sass = [item for item in items if item.nodeid.endswith("test_sass.py::test_sm90_sass")]
    if sass:
        import test_sass  # the sm_90a compile check runs in the background from here on

        # the cores the test workers leave, at least two (CI's machine has two cores: the
        # three processes share them, and the check's wait comes last, when it is all
        # that is left, instead of halfway through with one core idle; a 16-core GPU
        # machine with 4 test workers gives it 12: with 2 it was still compiling when
        # the rest of the suite had ended, run 261)
        testers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
        test_sass.start(workers=max(2, (os.cpu_count() or 2) - testers))
        items[:] = [item for item in items if item not in sass] + sass
    if ON_GPU:
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def pytest_sessionfinish(session, exitstatus):
    run = getattr(sys.modules.get("test_sass"), "_RUN", None)
    proc = (run or {}).get("proc")
    if proc is not None and proc.poll() is None and not os.path.exists(os.path.join(run["dir"], "rc")):
        interrupted = exitstatus not in (pytest.ExitCode.OK, pytest.ExitCode.TESTS_FAILED)
        if os.environ.get("PYTEST_XDIST_WORKER") and not interrupted:
            # another worker may be waiting for its result (a failed test here or there
            # must not cost it the check)
            sys.modules["test_sass"].finish(timeout=1500)
        else:  # the session stopped before the check was waited for
            sys.modules["test_sass"].stop()


@pytest.fixture(autouse=True)
def poison_outputs():
    """Every output and workspace the launcher allocates starts as NaN, so unwritten
    elements fail."""
    from codetta.kernels import settings

    with settings.override(poison_outputs=True):
        yield


@pytest.fixture
def shipped_triton(monkeypatch):
    """The shipped tables read as if this Triton were the series they were tuned under (they
    are skipped under another: tests of what they hold then run under any Triton, as
    scripts/triton_compat.sh does)."""
    from codetta.kernels import aot, tuning

    series = {tuning._series(ident.get("triton", "")) for ident in tuning.shipped_gpus().values()}
    assert len(series) == 1, f"the shipped tables were tuned under several Triton series: {series}"
    monkeypatch.setattr(tuning, "triton_series", lambda: next(iter(series)))
    aot._shipped_picks.cache_clear()  # (kept per process: read again under the patch, and after it)
    yield
    aot._shipped_picks.cache_clear()


@pytest.fixture
def device():
    return "cuda" if ON_GPU else "cpu"


DTYPES = [torch.bfloat16, torch.float16] if ON_GPU else [torch.float16, torch.float32]


@pytest.fixture(params=DTYPES, ids=lambda d: str(d).removeprefix("torch."))
def dtype(request):
    return request.param


@pytest.fixture(autouse=True)
def seed(request):
    # a different seed per test: fresh data, reproducible
    torch.manual_seed(zlib.crc32(request.node.nodeid.encode()))  # str hash() varies per process
