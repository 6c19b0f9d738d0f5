"""Where a training step's GPU time goes (GPU machine).

Per variant: torch.profiler's kernel table over a few steps of the model benchmark's
step, the time per step run back to back (the variant alone in the process, unlike the
benchmark, which keeps every variant's model alive), and the SM clock and power
sampled by nvidia-smi while the steps run. For the
codetta variants also every GEMM call of the step timed in place (CUDA events around
each ``gemm`` call the operators make, finishing kernels included), grouped by
program, layout and shape, next to cuBLAS's time for a GEMM of the same shape and
layout timed alone right after (paired): which calls lose time inside the step,
where isolated timing (scripts/call_ratios.py) may not show it; beside each, the least
bytes the call moves through HBM and the rate that makes at its time (a call near the
memory's bandwidth is bound by its epilogue's bytes, not its products). Then a second profiled
pass with the host side recorded: PyTorch's own ops (aten) by their self GPU time and
input shapes, which names the small elementwise kernels of the kernel table (a copy, a
fill, a mixed-dtype multiply) by the op and tensor that launched them.

Usage: python scripts/profile_step.py [case[@BxS]] [variants...]   (B sequences of S tokens;
default 4 x 4096)
(a variant ``codetta:no-pingpong`` runs codetta with the portable mainloop only,
``codetta:epilogue-bound`` with ``CODETTA_PINGPONG_POLICY=epilogue-bound``,
``codetta:qkv-one-launch`` with ``CODETTA_QKV_ONE_LAUNCH=1``)
"""

import collections
import importlib
import pkgutil
import subprocess
import sys

import torch

import codetta.ops
from codetta.bench import model as mb
from codetta.kernels import launch, settings
from codetta.kernels.operands import make_call
from codetta.kernels.program import STORE, Kind
from codetta.kernels.timing import paired_ms

STEPS = 3
# every operator module that calls the launcher's ``gemm`` by that name (codetta.ops
# re-exports functions of the same names). Until run 264 only cross_entropy,
# residual_rmsnorm and swiglu were wrapped: norm_backward's calls (the backward's dX and
# dW of every GEMM after a norm: q/k/v, gate/up) went untimed, ~60 ms of the 8B slice's
# 209 ms of GEMM kernels
_NAMES = [m.name for m in pkgutil.iter_modules(codetta.ops.__path__)]
_MODULES = (importlib.import_module(f"codetta.ops.{name}") for name in _NAMES)
_OPS = tuple(mod for mod in _MODULES if getattr(mod, "gemm", None) is launch.gemm)


class CallTimer:
    """Wraps the ``gemm`` the operators call: per call a pair of CUDA events and a key."""

    def __init__(self):
        self.marks = []
        self.bytes = {}  # key -> the least HBM bytes one call moves (``_least_bytes``)
        self.orig = {m: m.gemm for m in _OPS}

    def __enter__(self):
        for m, g in self.orig.items():
            m.gemm = self._wrap(g)
        return self

    def __exit__(self, *exc):
        for m, g in self.orig.items():
            m.gemm = g

    def _wrap(self, gemm):
        def timed(a, weight, *, epilogue=None, **kw):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            out = gemm(a, weight, epilogue=epilogue, **kw)
            end.record()
            key, call = _key(a, weight, epilogue, kw)
            if key not in self.bytes:
                self.bytes[key] = _least_bytes(call)
            self.marks.append((key, start, end))
            return out

        return timed

    def table(self, steps: int) -> dict:
        torch.cuda.synchronize()
        per = collections.defaultdict(list)
        for key, s, e in self.marks:
            per[key].append(s.elapsed_time(e))
        return {k: (sum(v) / steps, len(v) // steps) for k, v in per.items()}


def _key(a, w, prog, kw) -> tuple:
    """(program, layout, M, N, K, dtype) of the one plain GEMM doing the call's products:
    a paired weight doubles N; K parts add to K, N and M parts to N and M (the launcher's
    own sizes, ``GemmCall``): cuBLAS's time is that of one product over the concatenation
    (fewer launches and roundings than PyTorch's own sums); and the validated call."""
    ops = {k: v for k, v in kw.items() if k not in ("out", "config")}  # (not operands)
    call = make_call(prog or STORE, a, w, ops)
    n = call.N * (2 if call.program.pair_slot >= 0 else 1)
    lay = "".join("t" if t.stride(0) == 1 and t.shape[1] > 1 else "n" for t in (a, w))
    return (call.program.name, lay, call.M, n, call.k_total, a.dtype), call


def _least_bytes(call) -> int:
    """What one call must move through HBM at the least: a, the weight and every tensor
    input read once (K / N / M parts, seeds and tile inputs, vectors), every tile output
    written once (its declared dtype, else the GEMM's). Beside the call's time it says how
    near the call runs to the memory's bandwidth: an epilogue-heavy GEMM (dSwiGLU: g and u
    read, their gradients written) can be bound by these bytes, not by its products."""
    a_size = call.a.element_size()
    total = call.a.numel() * a_size + call.w.numel() * call.w.element_size()
    total += sum(t.numel() * t.element_size() for t in call.inputs if isinstance(t, torch.Tensor))
    for op in call.program.outputs:
        if op.kind not in (Kind.TILE, Kind.HALF_TILE, Kind.TILE_PART):
            continue
        rows, cols = call.out_dims(op) or (call.M, call.N)
        size = op.dtype.itemsize if op.dtype is not None else a_size
        total += rows * (cols // 2 if op.kind == Kind.HALF_TILE else cols) * size
    return total


def idle_report(case: str, name: str, prof, steps: int) -> None:
    """Where the GPU waits: the profiled steps' span minus the union of their kernels'
    intervals, the gaps binned by size, and the kernels that most often start after one
    (their name, and the one before: which launch the GPU waited for)."""
    kern = sorted(
        (e.time_range.start, e.time_range.end, e.name)
        for e in prof.events()
        if e.device_type == torch.autograd.DeviceType.CUDA
    )
    if not kern:
        print(f"== {case} {name}: no kernel intervals in the trace")
        return
    busy, gaps, end, prev = 0.0, [], kern[0][0], kern[0][2]
    for s, e, n in kern:
        if s > end:
            gaps.append((s - end, prev, n))
        busy += max(0.0, e - max(s, end))
        if e > end:
            end, prev = e, n
    span = end - kern[0][0]
    idle = span - busy
    per = len(kern) // steps
    print(f"== {case} {name}: GPU idle {idle / steps / 1e3:.2f} ms per step of a "
          f"{span / steps / 1e3:.2f} ms span ({per} kernels per step; profiled)")  # fmt: skip
    for lo, hi in ((0, 2), (2, 5), (5, 20), (20, 100), (100, float("inf"))):
        sel = [g for g, _, _ in gaps if lo <= g < hi]
        print(
            f"   gaps {lo:>4}-{hi:<5} us: {len(sel) // steps:5d} per step, {sum(sel) / steps / 1e3:7.3f} ms"
        )
    by = collections.defaultdict(lambda: [0.0, 0])
    for g, a, b in gaps:
        if g >= 5:
            key = f"{a[:45]} -> {b[:45]}"
            by[key][0] += g
            by[key][1] += 1
    for key, (g, c) in sorted(by.items(), key=lambda kv: -kv[1][0])[:12]:
        print(f"   {g / steps / 1e3:7.3f} ms  x{c // steps:<4d} {key}")


def ops_report(case: str, name: str, prof, steps: int, top: int = 24) -> None:
    """PyTorch's ops (aten::*) by the GPU time of the kernels they launched themselves,
    grouped by op and input shapes: which op (and tensor) each small kernel belongs to."""
    rows = [
        e
        for e in prof.key_averages(group_by_input_shape=True)
        if e.key.startswith("aten::") and e.self_device_time_total > 0
    ]
    total = sum(e.self_device_time_total for e in rows) / steps / 1e3
    print(f"== {case} {name}: PyTorch ops' own kernels {total:.2f} ms per step (host side recorded)")
    for e in sorted(rows, key=lambda e: -e.self_device_time_total)[:top]:
        shapes = str(e.input_shapes)[:90]
        ms = e.self_device_time_total / steps / 1e3
        print(f"  {ms:8.3f} ms  x{e.count // steps:<4d} {e.key:<32} {shapes}")


def _operand(rows, cols, transposed, dtype):
    t = torch.randn((cols, rows) if transposed else (rows, cols), device="cuda", dtype=dtype)
    return t.t() if transposed else t


def cublas_ms(key) -> float:
    _, lay, m, n, k, dtype = key
    if m == 0 or n == 0 or k == 0:
        return 0.0
    a, w = _operand(m, k, lay[0] == "t", dtype), _operand(n, k, lay[1] == "t", dtype)
    fn = lambda: a @ w.t()  # noqa: E731
    fn()
    return paired_ms({0: fn}, min_s=0.15, warm_s=0.05, min_cycles=10)[0]


# nvidia-smi's clock event ("throttle") reason bits
REASONS = {0x1: "idle", 0x2: "app clocks", 0x4: "SW power cap", 0x8: "HW slowdown", 0x20: "SW thermal",
           0x40: "HW thermal", 0x80: "HW power brake"}  # fmt: skip


class Clocks:
    """nvidia-smi sampling the SM clock (MHz) and the power (W) every 20 ms, and in a
    process of its own (a query field an older driver lacks fails only that one) the
    active clock event reasons: why the clock is below its maximum."""

    def __enter__(self):
        self.p = subprocess.Popen(
            ["nvidia-smi", "--query-gpu=clocks.sm,power.draw", "--format=csv,noheader,nounits", "-lms", "20"],
            stdout=subprocess.PIPE, text=True)  # fmt: skip
        self.r = subprocess.Popen(
            ["nvidia-smi", "--query-gpu=clocks_event_reasons.active", "--format=csv,noheader", "-lms", "20"],
            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)  # fmt: skip
        return self

    def __exit__(self, *exc):
        self.p.terminate()
        self.r.terminate()
        out, _ = self.p.communicate()
        vals = []
        for line in out.splitlines():
            try:
                clk, pw = (float(x) for x in line.split(","))
                vals.append((clk, pw))
            except ValueError:
                pass
        self.samples = vals
        out, _ = self.r.communicate()
        self.reasons = []
        for line in out.splitlines():
            try:
                self.reasons.append(int(line.strip(), 16))
            except ValueError:
                pass

    def summary(self) -> str:
        v = self.samples[len(self.samples) // 4 :]  # past nvidia-smi's start-up
        if not v:
            return "no clock samples"
        clk = sorted(c for c, _ in v)
        pw = sorted(p for _, p in v)
        return (f"SM clock median {clk[len(clk) // 2]:.0f} MHz (min {clk[0]:.0f}), "
                f"power median {pw[len(pw) // 2]:.0f} W ({len(v)} samples); clock held back by: "
                f"{self.why()}")  # fmt: skip

    def why(self) -> str:
        """The share of samples (past nvidia-smi's start-up) with each clock event reason."""
        r = self.reasons[len(self.reasons) // 4 :]
        if not r:
            return "not sampled"
        why = ", ".join(f"{name} {sum(1 for x in r if x & bit) / len(r):.0%}" for bit, name in REASONS.items()
                        if any(x & bit for x in r))  # fmt: skip
        return why or "nothing"


def main() -> None:
    spec = sys.argv[1] if len(sys.argv) > 1 else "1B-layers"
    variants = sys.argv[2:] or ["eager", "codetta"]
    # "case@BxS": batch B of S tokens (default the benchmark's 4 x 4096)
    case, _, shape = spec.partition("@")
    batch, seq = (int(x) for x in shape.split("x")) if shape else (mb.BATCH, mb.SEQ)
    config = mb.model_config(case, max_position_embeddings=max(seq, mb.SEQ))
    base = mb.make_model(config)
    g = torch.Generator(device="cuda").manual_seed(1)
    ids = torch.randint(0, config.vocab_size, (batch, seq), device="cuda", generator=g)
    for name in variants:
        variant, _, how = name.partition(":")
        # the setting stays in force through the call timer's cuBLAS timings too
        with settings.override(**mb.SETTING_VARIANTS.get(how, {})):
            profile_variant(spec, name, base, ids)


def profile_variant(case: str, name: str, base, ids) -> None:
    step = mb.variant_step(name, base, ids, ids.clone())
    for _ in range(STEPS):
        step()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    with Clocks() as clocks:
        start.record()
        for _ in range(4 * STEPS):
            step()
        end.record()
        torch.cuda.synchronize()
    wall = start.elapsed_time(end) / (4 * STEPS)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(STEPS):
            step()
        torch.cuda.synchronize()
    events = prof.key_averages()
    total = sum(e.device_time_total for e in events) / STEPS / 1e3
    print(f"== {case} {name}: {total:.2f} ms of kernels per step, {wall:.2f} ms per step back to back (this "
          f"variant alone in the process); {clocks.summary()}")  # fmt: skip
    rows = sorted(events, key=lambda e: -e.device_time_total)[:28]
    for e in rows:
        print(f"  {e.device_time_total / STEPS / 1e3:8.3f} ms  x{e.count // STEPS:<4d} {e.key[:110]}")
    idle_report(case, name, prof, STEPS)
    both = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=both, record_shapes=True) as prof:
        for _ in range(STEPS):
            step()
        torch.cuda.synchronize()
    ops_report(case, name, prof, STEPS)
    if not name.startswith("codetta"):
        return
    with CallTimer() as timer:
        for _ in range(STEPS):
            step()
    calls = timer.table(STEPS)
    print(f"== {case} {name}: GEMM calls in the step (CUDA events per call, {STEPS} steps)")
    print(f"  {'program':<16} {'lay':<3} {'M':>6} {'N':>6} {'K':>6} {'x':>3} {'ms/call':>8} "
          f"{'cuBLAS':>8} {'ratio':>6} {'excess ms/step':>14} {'GB/call':>8} {'TB/s':>5}")  # fmt: skip
    tot_in = tot_cb = 0.0
    for key, (ms, count) in sorted(calls.items(), key=lambda kv: -kv[1][0]):
        cb = cublas_ms(key)
        per = ms / max(count, 1)
        tot_in += ms
        tot_cb += cb * count
        gb = timer.bytes[key] / 1e9
        print(f"  {key[0]:<16} {key[1]:<3} {key[2]:>6} {key[3]:>6} {key[4]:>6} {count:>3} {per:8.3f} "
              f"{cb:8.3f} {per / cb if cb else float('nan'):6.3f} {ms - cb * count:+14.3f} "
              f"{gb:8.3f} {gb / per if per else float('nan'):5.2f}")  # fmt: skip
    print(f"== {case} {name}: GEMM calls {tot_in:.2f} ms per step, cuBLAS alone {tot_cb:.2f} ms "
          f"({tot_in / tot_cb:.3f}x)")  # fmt: skip


if __name__ == "__main__":
    main()
