"""Where K1's host time goes at a new token count each call (GPU machine): Triton's
``JITCallable.cache_key`` wrapped to time each call, per function and thread count,
with the stack of its first slow call.

Run 307 (an H100, scripts/profile_new_m.py): under cProfile, 600 ``cache_key`` calls for
200 K1 calls held 153 ms of own time (~255 us each) while the property returns a hash
cached after its first call (~1 us on a CPU). This finds which function's key is slow and
who asks for it (a new JIT object each call, a lock held elsewhere, or the GIL), and times
the garbage collector beside it: since Python 3.12 a collection runs at the next function
entry after the allocation threshold trips, so its time lands in whatever function is
entered then (``cache_key``, entered right after launch_jit builds its key tuples, would
be one); then the same calls after a full collection (as the bench's overhead table now
times them), and with the collector off.

Usage (repo root): python scripts/cache_key_probe.py
"""

import collections
import gc
import threading
import time
import traceback

import triton.runtime.jit as jit

from codetta.bench.foundation import new_m_calls
from codetta.bench.harness import cpu_overhead_us

_KEY = jit.JITCallable.cache_key.fget
TIMES: dict = collections.defaultdict(list)
FIRST_SLOW: dict = {}


def _timed_key(self):
    fresh = getattr(self, "hash", None) is None  # (no cached hash: the key is computed now)
    t = time.perf_counter()
    value = _KEY(self)
    dt = time.perf_counter() - t
    k = (getattr(self, "_fn_name", type(self).__name__), id(self), fresh, threading.active_count())
    TIMES[k].append(dt)
    if dt > 50e-6 and k not in FIRST_SLOW:
        FIRST_SLOW[k] = "".join(traceback.format_stack(limit=9)[:-1])
    return value


GC: dict = collections.defaultdict(list)  # generation -> seconds of each collection
_gc_start = [0.0]


def _gc_timer(phase, info):
    if phase == "start":
        _gc_start[0] = time.perf_counter()
    else:
        GC[info["generation"]].append(time.perf_counter() - _gc_start[0])


def print_collections(note: str = "") -> None:
    print(f"  collections{note}:", {g: f"{len(ts)}x, {1e3 * sum(ts):.1f} ms" for g, ts in sorted(GC.items())})


jit.JITCallable.cache_key = property(_timed_key)
gc.callbacks.append(_gc_timer)
fns = new_m_calls()
print("threads:", [t.name for t in threading.enumerate()], "gc thresholds", gc.get_threshold())
for name in ("codetta", "codetta-k1"):
    TIMES.clear()
    GC.clear()
    # (collect=False: as run 307's profile_new_m.py, the setup's collection debt not paid first)
    print(f"{name}: {cpu_overhead_us(fns[name], 150, collect=False):.0f} us/call, a new M each call")
    print_collections()
    for (fn, ident, fresh, threads), ts in sorted(TIMES.items(), key=lambda kv: -sum(kv[1]))[:8]:
        print(
            f"  {fn} (object {ident:x}, computed {fresh}, {threads} threads): {len(ts)} calls, "
            f"{1e3 * sum(ts):.1f} ms, largest {1e6 * max(ts):.0f} us"
        )
fns = new_m_calls(first=2048)  # (new counts for the rows below: the first set's are seen)
for name in ("codetta", "codetta-k1"):
    GC.clear()
    print(f"{name}, collected first: {cpu_overhead_us(fns[name], 150):.0f} us/call, a new M each call")
    print_collections(" (generation 2 counts the timer's own, before its timed calls)")
    gc.disable()
    print(f"{name}, collector off: {cpu_overhead_us(fns[name], 150):.0f} us/call, a new M each call")
    gc.enable()
for k, stack in list(FIRST_SLOW.items())[:3]:
    print("== first slow call of", k[0], "\n" + stack)
