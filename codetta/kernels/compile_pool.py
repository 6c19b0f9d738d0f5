"""Triton compiles in forked child processes, many at once.

Triton's asynchronous compile mode hands each compile to an executor, but a thread
pool gains little: most of a compile (the frontend's code generation and the MLIR
passes) holds the GIL. Measured on the H200's host (run 91, NOTES.md): 12 kernels of
a model step took 12.6 s in 16 threads against ~1.1 s each one after another.

``compiling_in_children()`` defers every compile started inside it; on leaving, it
forks child processes that run the deferred compiles side by side (each writes its
result into Triton's on-disk cache and exits; a child never touches CUDA, and its
failure only costs time), then runs every compile once more in this process, where
it finds the cache filled (tens of milliseconds each) or, for a compile a child did
not finish, compiles it here. So the results are this process's own compiles; the
children only warm the cache. Where ``os.fork`` does not exist, the compiles run
here one after another.
"""

from __future__ import annotations

import contextlib
import gc
import os
import time
from concurrent.futures import CancelledError, Executor, Future

CHILD_TIMEOUT_S = 600.0  # a child still compiling after this is killed (its jobs compile here)


class DeferredCompiles(Executor):
    """An executor that only records what it is given, until ``run``."""

    def __init__(self):
        self.jobs: list[tuple[Future, object, tuple, dict]] = []

    def submit(self, fn, /, *args, **kwargs) -> Future:
        future: Future = Future()
        self.jobs.append((future, fn, args, kwargs))
        return future

    def run(self, workers: int | None = None) -> None:
        """Warm the cache in up to ``workers`` forked children, then run every job here."""
        jobs = [j for j in self.jobs if not j[0].done()]
        workers = min(len(jobs), workers or os.cpu_count() or 1)
        if workers > 1 and hasattr(os, "fork"):
            _in_children([(fn, args, kwargs) for _, fn, args, kwargs in jobs], workers)
        for future, fn, args, kwargs in jobs:
            try:
                future.set_result(fn(*args, **kwargs))
            except BaseException as exc:  # noqa: BLE001 - the caller's mode decides what an error means
                future.set_exception(exc)

    def cancel_all(self) -> None:
        for future, *_ in self.jobs:
            if not future.done():
                future.set_exception(CancelledError())


def _in_children(jobs: list, workers: int) -> None:
    """Run ``jobs`` (``(fn, args, kwargs)``) split round-robin over ``workers`` forked
    children; wait for them (killing any past ``CHILD_TIMEOUT_S``). Results are dropped."""
    pids = []
    for w in range(workers):
        pid = os.fork()
        if pid == 0:  # the child: compile its share, never return into the parent's code
            code = 0
            try:
                gc.disable()  # (collecting a parent's CUDA tensor here would call into CUDA)
                for fn, args, kwargs in jobs[w::workers]:
                    try:
                        fn(*args, **kwargs)
                    except BaseException:  # noqa: BLE001 - the parent compiles it again and reports
                        code = 1
            finally:
                os._exit(code)
        pids.append(pid)
    deadline = time.monotonic() + CHILD_TIMEOUT_S
    for pid in pids:
        while True:
            done, _ = os.waitpid(pid, os.WNOHANG)
            if done:
                break
            if time.monotonic() > deadline:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, 9)
                os.waitpid(pid, 0)
                break
            time.sleep(0.01)


@contextlib.contextmanager
def compiling_in_children(workers: int | None = None, ignore_errors: bool = False):
    """Inside, every Triton compile is deferred (a launch gets a future: launch with
    ``warmup=True``); on leaving without an error, all of them compile at once
    (``DeferredCompiles.run``) and the futures hold the kernels. ``ignore_errors``: a
    failed compile leaves its future empty instead of raising here."""
    from triton.runtime._async_compile import AsyncCompileMode

    pool = DeferredCompiles()
    mode = AsyncCompileMode(pool, ignore_errors=ignore_errors)
    mode.__enter__()
    try:
        yield mode
    except BaseException:
        pool.cancel_all()
        mode.ignore_errors = True
        mode.__exit__(None, None, None)
        raise
    pool.run(workers)
    mode.__exit__(None, None, None)
