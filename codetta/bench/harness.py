"""The shared benchmark harness: time variants side by side in one run, record
ms, TFLOP/s, the ratio to the cuBLAS GEMM-only time, peak memory, the GPU,
versions and git commit; write CSV + JSON and a PNG plot."""

from __future__ import annotations

import csv
import datetime
import json
import math
import os
import subprocess
from dataclasses import asdict, dataclass, field

import torch
import triton

from ..kernels.timing import paired_ms


def source_hash() -> str:
    """sha256 (12 hex digits) of the package's Python sources: names the code that
    ran even where the commit label is wrong (the GPU machine's copy of the tree can
    carry a stale .git). Check out a commit and call this to match a result to it."""
    import hashlib
    import pathlib

    root = pathlib.Path(__file__).resolve().parents[1]
    h = hashlib.sha256()
    for path in sorted(root.rglob("*.py")):
        h.update(path.relative_to(root).as_posix().encode() + b"\0" + path.read_bytes() + b"\0")
    return h.hexdigest()[:12]


def env_info() -> dict:
    # the GPU machine gets a copy of the working tree whose .git may lag: the
    # caller names the commit there
    commit = os.environ.get("CODETTA_COMMIT")
    try:
        if commit:
            raise OSError("commit given")
        commit = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            check=True,
            cwd=os.path.dirname(os.path.abspath(__file__)),
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            capture_output=True,
            text=True,
            cwd=os.path.dirname(os.path.abspath(__file__)),
        ).stdout.strip()
        commit += "-dirty" if dirty else ""
    except (OSError, subprocess.CalledProcessError):
        commit = commit or "unknown"
    from .. import __version__

    return {
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "triton": triton.__version__,
        "codetta": __version__,
        "commit": commit,
        "source": source_hash(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }


@dataclass
class Row:
    case: str  # e.g. "plain 16384x2048x2048"
    variant: str  # cublas, codetta, torch.compile, eager, liger
    ms: float
    flops: float
    baseline_ms: float  # the cuBLAS GEMM-only time of the same case
    peak_mem_gb: float = float("nan")
    extra: dict = field(default_factory=dict)

    @property
    def tflops(self) -> float:
        return self.flops / self.ms / 1e9

    @property
    def ratio(self) -> float:
        return self.ms / self.baseline_ms


def compare(fns: dict) -> dict:
    """Median time in ms of each variant of one case, measured paired
    (``codetta.kernels.timing.paired_ms``: variants alternate call by call under
    sustained load, at least 2 s of GPU time)."""
    for fn in fns.values():  # compile, tune, allocate
        fn()
    torch.cuda.synchronize()
    return paired_ms(fns)


def rand_bf16(*shape, scale=1.0):
    """Benchmark data: standard normal (times ``scale``) in bf16 on the GPU."""
    return (torch.randn(*shape, device="cuda") * scale).to(torch.bfloat16)


def rel_error(ours: torch.Tensor, ref: torch.Tensor) -> float:
    """Relative Frobenius error, for the benchmarks' sanity checks against PyTorch (the
    tests hold the real fp64 bounds)."""
    return ((ours.float() - ref.float()).norm() / ref.float().norm()).item()


def with_env(fn, **env):
    """``fn`` run with these environment variables set (restored after), for A/B variants
    that differ only in a launcher switch (the tuner keys its choices on them)."""

    def run(*args, **kwargs):
        old = {k: os.environ.get(k) for k in env}
        os.environ.update(env)
        try:
            return fn(*args, **kwargs)
        finally:
            for k, v in old.items():
                if v is None:
                    del os.environ[k]
                else:
                    os.environ[k] = v

    return run


def triton_only(fn):
    """``fn`` with the sm_90 ping-pong mainloop left out of the tuner's choice: every GEMM
    on the Triton mainloop, as before it existed (A/B variant)."""
    return with_env(fn, CODETTA_PINGPONG="0")


def cpu_overhead_us(fn, calls: int = 300) -> float:
    """Host time per call of fn when the GPU is not the bottleneck (tiny problem)."""
    import time

    for _ in range(10):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    return (t1 - t0) / calls * 1e6


def peak_memory_gb(fn) -> float:
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2**30


def geomean(xs) -> float:
    xs = list(xs)
    return math.exp(sum(math.log(x) for x in xs) / len(xs)) if xs else float("nan")


class Results:
    def __init__(self, name: str):
        self.name = name
        self.rows: list[Row] = []
        self.env = env_info()

    def add(self, row: Row) -> Row:
        self.rows.append(row)
        print(
            f"  {row.case:<34} {row.variant:<16} {row.ms:8.3f} ms  {row.tflops:6.0f} TFLOP/s  "
            f"x{row.ratio:.3f}",
            flush=True,
        )
        return row

    def table(self) -> str:
        variants = list(dict.fromkeys(r.variant for r in self.rows))
        cases = list(dict.fromkeys(r.case for r in self.rows))
        by = {(r.case, r.variant): r for r in self.rows}
        w = max([16] + [len(v) + 2 for v in variants])
        head = f"{'case':<34}" + "".join(f"{v:>{w}}" for v in variants)
        lines = [
            f"{self.name}: time / cuBLAS GEMM-only time ({self.env['gpu']}, commit {self.env['commit']})",
            head,
        ]
        for c in cases:
            cells = [f"{by[(c, v)].ratio:>{w}.3f}" if (c, v) in by else f"{'-':>{w}}" for v in variants]
            lines.append(f"{c:<34}" + "".join(cells))
        lines.append(
            f"{'geomean':<34}"
            + "".join(f"{geomean(r.ratio for r in self.rows if r.variant == v):>{w}.3f}" for v in variants)
        )
        return "\n".join(lines)

    def write(self, out_dir: str) -> None:
        os.makedirs(out_dir, exist_ok=True)
        base = os.path.join(out_dir, self.name)
        recs = [{**asdict(r), "tflops": r.tflops, "ratio": r.ratio, **self.env} for r in self.rows]
        with open(base + ".json", "w") as f:
            json.dump({"env": self.env, "rows": recs}, f, indent=1)
        if recs:
            with open(base + ".csv", "w", newline="") as f:
                w = csv.DictWriter(f, fieldnames=[k for k in recs[0] if k != "extra"])
                w.writeheader()
                for r in recs:
                    w.writerow({k: v for k, v in r.items() if k != "extra"})
        with open(base + ".txt", "w") as f:
            f.write(self.table() + "\n")
        self.plot(base + ".png")

    def plot(self, path: str) -> None:
        try:
            import matplotlib

            matplotlib.use("Agg")
            import matplotlib.pyplot as plt
        except ImportError:
            print("matplotlib not installed: no plot")
            return
        variants = list(dict.fromkeys(r.variant for r in self.rows))
        cases = list(dict.fromkeys(r.case for r in self.rows))
        by = {(r.case, r.variant): r.ratio for r in self.rows}
        fig, ax = plt.subplots(figsize=(max(6, 1.3 * len(cases)), 4))
        width = 0.8 / len(variants)
        for i, v in enumerate(variants):
            xs = [j + i * width for j, c in enumerate(cases) if (c, v) in by]
            ys = [by[(c, v)] for c in cases if (c, v) in by]
            ax.bar(xs, ys, width, label=v)
        ax.axhline(1.0, color="k", lw=0.8)
        ax.set_xticks([j + 0.4 - width / 2 for j in range(len(cases))])
        ax.set_xticklabels(cases, rotation=30, ha="right", fontsize=8)
        ax.set_ylabel("time / cuBLAS GEMM-only")
        ax.set_title(f"{self.name} on {self.env['gpu']} ({self.env['commit']})", fontsize=9)
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(path, dpi=120)
        plt.close(fig)
