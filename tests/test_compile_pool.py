"""compile_pool: deferred compiles warmed in forked children, then run in this process
(the mechanism, with plain Python jobs standing in for Triton's compiles)."""

import os

import pytest

from codetta.kernels.compile_pool import LAST_RUN, DeferredCompiles, compiling_in_children


def _job(path, value):
    def run():
        with open(path, "a") as f:
            f.write(f"{os.getpid()}\n")
        if value is None:
            raise RuntimeError("cannot compile")
        return value * 2

    return run


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_children_warm_then_parent_runs_every_job(tmp_path):
    pool = DeferredCompiles()
    futures = [pool.submit(_job(tmp_path / f"j{i}", v)) for i, v in enumerate([1, 2, None, 4])]
    assert not any(f.done() for f in futures)  # deferred until run
    with pytest.warns(UserWarning, match="1 compile.s. failed in a child process.*cannot compile"):
        pool.run(workers=3)
    assert LAST_RUN["jobs"] == 4 and LAST_RUN["workers"] == 3 and len(LAST_RUN["child_errors"]) == 1
    assert [f.result() for f in futures if f.exception() is None] == [2, 4, 8]
    assert isinstance(futures[2].exception(), RuntimeError)
    for i in range(4):
        pids = (tmp_path / f"j{i}").read_text().split()
        # each job ran once in a child and once here, in that order
        assert len(pids) == 2 and pids[1] == str(os.getpid()) != pids[0]


def test_mode_finalizes_on_exit_and_a_failing_body_does_not_hang(tmp_path):
    done = []
    with compiling_in_children(workers=2) as mode:
        fk = mode.submit("k", _job(tmp_path / "a", 21), done.append)
        assert done == []
    assert done == [42] and fk.result() == 42
    with pytest.raises(ValueError, match="the step failed"):
        with compiling_in_children(workers=2) as mode:
            mode.submit("k", _job(tmp_path / "b", 1), done.append)
            raise ValueError("the step failed")
    assert not (tmp_path / "b").exists()  # nothing compiled after a failed body


def test_the_mode_is_seen_from_other_threads(tmp_path):
    """A step's backward runs in PyTorch's autograd threads: a compile started there is
    deferred too (Triton's own ContextVar would not show the mode in another thread)."""
    import threading

    from triton.runtime import _async_compile

    seen = []
    with compiling_in_children(workers=2):
        t = threading.Thread(target=lambda: seen.append(_async_compile.active_mode.get()))
        t.start()
        t.join()
    assert seen[0] is not None
    assert _async_compile.active_mode.get() is None  # (Triton's ContextVar is back)
    assert type(_async_compile.active_mode).__name__ == "ContextVar"


def test_one_worker_compiles_here_only(tmp_path):
    """CODETTA_COMPILE_WORKERS=1 (where forking is unsafe): no child runs any job."""
    from codetta.kernels.settings import override

    pool = DeferredCompiles()
    futures = [pool.submit(_job(tmp_path / f"j{i}", i)) for i in range(3)]
    with override(compile_workers=1):
        pool.run()
    assert [f.result() for f in futures] == [0, 2, 4]
    for i in range(3):
        assert (tmp_path / f"j{i}").read_text().split() == [str(os.getpid())]
    from codetta.kernels.settings import Settings

    assert Settings.from_env({}).compile_workers == 0
    assert Settings.from_env({"CODETTA_COMPILE_WORKERS": "1"}).compile_workers == 1
    with pytest.raises(ValueError, match="CODETTA_COMPILE_WORKERS"):
        Settings.from_env({"CODETTA_COMPILE_WORKERS": "-2"})
