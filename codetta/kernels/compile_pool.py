"""Triton compiles in forked child processes, many at once.

Triton's asynchronous compile mode hands each compile to an executor, but a thread
pool gains little: most of a compile (the frontend's code generation and the MLIR
passes) holds the GIL. Measured on the H200's host (run 91, NOTES.md): 12 kernels of
a model step took 12.6 s in 16 threads against ~1.1 s each one after another.

``compiling_in_children()`` defers every compile started inside it, in any thread (a
step's backward launches from PyTorch's autograd threads); on leaving, it forks child
processes that run the deferred compiles side by side and build each kernel's C
launcher (all of it lands in Triton's on-disk cache; a child never touches CUDA, and
its failure only costs time), then runs every compile once more in this process, where
it finds the cache filled (~2 ms each on the H200's host) or, for a compile a child did
not finish, compiles it here. So the results are this process's own compiles; the
children only warm the cache. Without ``os.fork``, or with ``CODETTA_COMPILE_WORKERS=1``,
the compiles run here one after another.
"""

from __future__ import annotations

import contextlib
import gc
import os
import shutil
import tempfile
import time
import traceback
import warnings
from concurrent.futures import CancelledError, Executor, Future

from .settings import SETTINGS

# a child still compiling after this is killed (its jobs then compile here): the largest
# kernels took ~5 s alone on the H200's host
CHILD_TIMEOUT_S = 180.0
# the last run's numbers: jobs, workers, seconds in the children and here, children's errors
LAST_RUN: dict = {}


class DeferredCompiles(Executor):
    """An executor that only records what it is given, until ``run``. ``in_child(result)``,
    if given, runs in a child after each job that returned (e.g. building the kernel's
    launcher, which Triton otherwise compiles with the C compiler at its first launch)."""

    def __init__(self, in_child=None, warn: bool = True):
        self.jobs: list[tuple[Future, object, tuple, dict]] = []
        self.in_child = in_child
        self.warn = warn  # about compiles that failed in a child (not where failures are expected)

    def submit(self, fn, /, *args, **kwargs) -> Future:
        future: Future = Future()
        self.jobs.append((future, fn, args, kwargs))
        return future

    def run(self, workers: int | None = None) -> None:
        """Warm the cache in up to ``workers`` forked children (default: the
        ``compile_workers`` setting, else one per CPU core; 1: none), then run every job here."""
        jobs = [j for j in self.jobs if not j[0].done()]
        workers = min(len(jobs), workers or SETTINGS.compile_workers or os.cpu_count() or 1)
        t0 = time.perf_counter()
        errors = []
        if workers > 1 and hasattr(os, "fork"):
            calls = [(fn, args, kwargs) for _, fn, args, kwargs in jobs]
            errors = _in_children(calls, workers, self.in_child)
        t1 = time.perf_counter()
        for future, fn, args, kwargs in jobs:
            try:
                future.set_result(fn(*args, **kwargs))
            except BaseException as exc:  # noqa: BLE001 - the caller's mode decides what an error means
                future.set_exception(exc)
        LAST_RUN.clear()
        LAST_RUN.update(jobs=len(jobs), workers=workers, children_s=t1 - t0, here_s=time.perf_counter() - t1,
                        child_errors=errors)  # fmt: skip
        if errors and self.warn:
            warnings.warn(f"codetta: {len(errors)} compile(s) failed in a child process (compiled here "
                          f"instead, one after another); the first: {errors[0]}", stacklevel=3)  # fmt: skip

    def cancel_all(self) -> None:
        for future, *_ in self.jobs:
            if not future.done():
                future.set_exception(CancelledError())


def _in_children(jobs: list, workers: int, in_child=None) -> list[str]:
    """Run ``jobs`` (``(fn, args, kwargs)``) split round-robin over ``workers`` forked
    children; wait for them (killing any past ``CHILD_TIMEOUT_S``). Results are dropped;
    returns the children's errors (the last line of each traceback)."""
    errdir = tempfile.mkdtemp(prefix="codetta-compile-")
    pids = []
    for w in range(workers):
        with warnings.catch_warnings():
            # (Python warns that forking a threaded process may deadlock the child: a child
            # here only compiles, and one that hangs is killed and its work redone here)
            warnings.simplefilter("ignore", DeprecationWarning)
            pid = os.fork()
        if pid == 0:  # the child: compile its share, never return into the parent's code
            code = 0
            try:
                gc.disable()  # (collecting a parent's CUDA tensor here would call into CUDA)
                for i, (fn, args, kwargs) in enumerate(jobs[w::workers]):
                    try:
                        result = fn(*args, **kwargs)
                        if in_child is not None:
                            in_child(result)
                    except BaseException:  # noqa: BLE001 - the parent compiles it again
                        code = 1
                        with open(os.path.join(errdir, f"{w}-{i}.txt"), "w") as f:
                            f.write(traceback.format_exc())
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
    errors = []
    for name in sorted(os.listdir(errdir)):
        with open(os.path.join(errdir, name)) as f:
            lines = f.read().strip().splitlines()
        errors.append(lines[-1] if lines else "?")
    shutil.rmtree(errdir, ignore_errors=True)
    return errors


@contextlib.contextmanager
def compiling_in_children(workers: int | None = None, ignore_errors: bool = False):
    """Inside, every Triton compile is deferred (a launch gets a future: launch with
    ``warmup=True``); on leaving without an error, all of them compile at once
    (``DeferredCompiles.run``; the children build each kernel's launcher too) and the
    futures hold the kernels. ``ignore_errors``: a failed compile leaves its future empty
    instead of raising here."""
    from triton.runtime import _async_compile

    pool = DeferredCompiles(in_child=_build_launcher, warn=not ignore_errors)
    mode = _async_compile.AsyncCompileMode(pool, ignore_errors=ignore_errors)
    # Triton keeps the active mode in a ContextVar, which PyTorch's autograd threads (where
    # a step's backward launches its kernels) do not see: their compiles would run there,
    # one after another (run 93: 11 of a step's 23 kernels). For the duration, one mode
    # for every thread.
    per_context, _async_compile.active_mode = _async_compile.active_mode, _EveryThread()
    try:
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
    finally:
        _async_compile.active_mode = per_context


class _EveryThread:
    """``ContextVar``'s get/set, one value for all threads."""

    def __init__(self):
        self.value = None

    def get(self):
        return self.value

    def set(self, value):
        self.value = value


def _build_launcher(kernel) -> None:
    """Compile (into Triton's cache) the C launcher a kernel's first launch would build:
    host code only, no CUDA call."""
    if hasattr(kernel, "src") and hasattr(kernel, "metadata"):
        from triton.runtime import driver

        driver.active.launcher_cls(kernel.src, kernel.metadata)
