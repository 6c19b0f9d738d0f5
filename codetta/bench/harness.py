"""The shared benchmark harness: time variants side by side in one run, two ways
(paired: call by call; sustained: blocks of one variant at a time), record ms,
TFLOP/s, the ratio to the cuBLAS GEMM-only time under each method, peak memory,
the GPU, versions and git commit; write CSV + JSON and a PNG plot."""

from __future__ import annotations

import csv
import datetime
import gc
import json
import math
import os
import subprocess
import tempfile
import time
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

import torch
import triton

from ..kernels import settings
from ..kernels.timing import paired_ms, sustained_ms
from ..kernels.tuning import CHOOSER


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
    ms: float  # paired timing
    flops: float
    baseline_ms: float  # the cuBLAS GEMM-only time of the same case (paired)
    peak_mem_gb: float = float("nan")
    extra: dict = field(default_factory=dict)
    sustained_ms: float = float("nan")
    baseline_sustained_ms: float = float("nan")

    @property
    def tflops(self) -> float:
        return self.flops / self.ms / 1e9

    @property
    def ratio(self) -> float:
        return self.ms / self.baseline_ms

    @property
    def ratio_sustained(self) -> float:
        return self.sustained_ms / self.baseline_sustained_ms


@dataclass
class Timing:
    paired: float  # the median over rounds (``OPTIONS.rounds``) of each method's time
    sustained: float
    rounds: list = field(default_factory=list)  # (paired, sustained) per round, with rounds > 1


@dataclass
class Options:
    """Options of a whole ``codetta bench`` run (set from its command line)."""

    # beside "codetta": "codetta:shipped" (the shipped table alone) and "codetta:tuned"
    # (every shape tuned here on its first call), issue 11's check of the shipped table
    tuned_ab: bool = False
    # the variants to time beside the cuBLAS baseline in the operator tables (None: all of
    # them); codetta stays in while its A/B variants are asked for (they derive from it)
    variants: tuple | None = None
    # sustained timing: ms of a variant's own calls, untimed, before each of its blocks
    # (timing.sustained_ms; 0 is the method of the runs before 2026-12-01's last)
    settle_ms: float = 120.0
    # under tuned_ab, one tuned variant per tuning method named here ("codetta:tuned-both",
    # ...; settings.TUNE_METHODS) instead of the one "codetta:tuned" (CODETTA_TUNE_METHOD)
    tune_methods: tuple = ()
    # the whole paired + sustained timing repeated this many times, the median reported and
    # every round kept (a ratio's spread within one run, beside the 1-3 % between runs)
    rounds: int = 1


OPTIONS = Options()
AB_VARIANTS = ("codetta:shipped", "codetta:tuned")
_AB_DIRS: dict = {}


def ab_variants() -> tuple:
    """The A/B variants' names this run times beside codetta (``--tuned-ab``)."""
    if not OPTIONS.tune_methods:
        return AB_VARIANTS
    return ("codetta:shipped", *(f"codetta:tuned-{m}" for m in OPTIONS.tune_methods))


def ab_settings(how: str) -> dict:
    """The settings of an A/B variant that sets the shipped table against tuning on this
    GPU: "shipped": an empty tuning cache of its own (the shipped table, else its nearest
    entry or the shape rule); "tuned": the shipped table ignored and every shape tuned on
    its first call (``CODETTA_TUNE_SECONDS`` of paired timing, or as ``CODETTA_TUNE_METHOD``
    says) into a cache of its own;
    "tuned-METHOD": the same, its candidates timed by that method
    (``settings.TUNE_METHODS``); "tuned-METHOD+tail": and with ``CODETTA_TAIL_LAUNCH=1``
    (the tail-split candidates among the tuner's choice)."""
    method, plus, extra = how.partition("-")[2].partition("+") if how.startswith("tuned-") else (None, "", "")
    if how not in ("shipped", "tuned") and (method not in settings.TUNE_METHODS or plus and extra != "tail"):
        raise ValueError(f"unknown A/B variant {how!r}: shipped, tuned or tuned-<method>[+tail] "
                         f"({', '.join(settings.TUNE_METHODS)})")  # fmt: skip
    if how not in _AB_DIRS:
        _AB_DIRS[how] = Path(tempfile.mkdtemp(prefix=f"codetta-{how.replace('+', '-')}-"))
    if how == "shipped":
        return {"cache_dir": _AB_DIRS[how], "autotune": False}
    changes = {"tune_method": method} if method else {}
    if extra:
        changes["tail_launch"] = True
    return {"cache_dir": _AB_DIRS[how], "autotune": True, "shipped": False, **changes}


def save_ab_caches(out_dir) -> list[Path]:
    """Each tuned A/B variant's tuning cache copied to ``<out_dir>/ab-tuned/<variant>.json``
    (the shipped table's format: ``scripts/merge_tuned.py`` merges its picks into a table),
    so the picks of a tuning run come back with the results. Returns the files written."""
    import shutil

    written = []
    for how, folder in sorted(_AB_DIRS.items()):
        cache = Path(folder) / "tuning.json"
        if how != "shipped" and cache.exists():
            dest = Path(out_dir) / "ab-tuned" / f"{how}.json"
            dest.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(cache, dest)
            written.append(dest)
    return written


def with_ab_variants(fns: dict) -> dict:
    """``fns`` with "codetta:shipped" and "codetta:tuned" beside "codetta" when the run asks
    for them (``OPTIONS.tuned_ab``)."""
    names = ab_variants()
    if not OPTIONS.tuned_ab or "codetta" not in fns or names[-1] in fns:
        return fns
    return {**fns, **{name: with_settings(fns["codetta"], **ab_settings(name.split(":")[1]))
                      for name in names}}  # fmt: skip


def selected(fns: dict) -> dict:
    """``fns`` less the variants the run did not ask for (``OPTIONS.variants``): the
    baseline (the operator tables' cuBLAS, the model step's floor) always stays, and so do
    codetta and its A/B variants under ``--tuned-ab``."""
    keep = OPTIONS.variants
    if keep is None:
        return fns
    ab = ("codetta", *ab_variants()) if OPTIONS.tuned_ab else ()
    return {k: v for k, v in fns.items() if k in BASELINES or k in keep or k in ab}


BASELINES = ("cublas", "floor")  # what every table's ratios divide by


def precompile_variants(fns: dict) -> None:
    """The codetta variants' kernels compiled all at once (``codetta.precompile``) before
    their first calls compile them one by one: device time saved. Not for a variant that
    tunes on its first call (``codetta:tuned``: its candidates compile in the tuner). A
    failure only costs that time: the first calls compile what is left. Only for callables
    whose calls leave nothing later calls read: in the dry run codetta's kernels do not
    run, so a model step with its optimizer would train on garbage gradients (run 97's
    model table timed weights the dry run had ruined; the model part precompiles each step
    itself, forward and backward only)."""
    from ..kernels.precompile import precompile

    mine = [
        fn for name, fn in fns.items() if name.startswith("codetta") and not name.startswith("codetta:tuned")
    ]
    if not mine:
        return

    def run_all():
        for fn in mine:
            fn()  # (its outputs dropped before the next one runs)

    try:
        precompile(run_all)
    except Exception as exc:  # noqa: BLE001 - a benchmark runs on without it
        print(f"  (precompile failed: {type(exc).__name__}: {exc}; compiling at the first calls)", flush=True)


def compare(fns: dict, precompile: bool = True) -> dict[str, Timing]:
    """Each variant of one case timed two ways in one run: paired
    (``timing.paired_ms``: call by call, at least 2 s) and sustained blocks
    (``timing.sustained_ms``: >= 120 ms of one variant at a time, 5 rotating rounds);
    first, where the GEMM configurations it picked came from (``config_sources``). With
    ``OPTIONS.tuned_ab``, codetta's two A/B variants too (``with_ab_variants``);
    only the variants the run asked for (``selected``). ``precompile``: the codetta
    variants' kernels compiled first by a dry run of each (``precompile_variants``; False
    for callables with state, such as training steps)."""
    fns = selected(with_ab_variants(fns))
    seen = set(CHOOSER.served)
    if precompile:
        precompile_variants(fns)
    for fn in fns.values():  # compile (what precompile left), tune, allocate
        fn()
    torch.cuda.synchronize()
    print_config_sources(seen)  # (the keys this case picked first)
    rounds = []
    for _ in range(max(1, OPTIONS.rounds)):
        rounds.append((paired_ms(fns), sustained_ms(fns, settle_ms=OPTIONS.settle_ms)))
    if len(rounds) == 1:
        return {k: Timing(rounds[0][0][k], rounds[0][1][k]) for k in fns}
    return {
        k: Timing(_median([p[k] for p, _ in rounds]), _median([s[k] for _, s in rounds]),
                  [(p[k], s[k]) for p, s in rounds])
        for k in fns
    }  # fmt: skip


def _median(xs: list) -> float:
    xs = sorted(xs)
    n = len(xs)
    return xs[n // 2] if n % 2 else (xs[n // 2 - 1] + xs[n // 2]) / 2


def round_spread(t: Timing, base: Timing) -> str:
    """'paired lo-hi, sustained lo-hi' of the ratio t / base round by round ('' for one round)."""
    if not t.rounds:
        return ""
    p = [a[0] / b[0] for a, b in zip(t.rounds, base.rounds)]
    s = [a[1] / b[1] for a, b in zip(t.rounds, base.rounds)]
    return f"rounds: paired {min(p):.3f}-{max(p):.3f}, sustained {min(s):.3f}-{max(s):.3f}"


def add_rows(res: Results, case: str, flops: float, times: dict, mem: dict | None = None, base="cublas",
             host: dict | None = None):  # fmt: skip
    """One row per variant, ratios against the ``base`` variant under both methods;
    ``host``: each variant's ``host_ms`` (kept in the JSON, and printed beside its time:
    where it reaches the time, the host set the pace)."""
    b = times[base]
    for name, t in times.items():
        mb = (mem or {}).get(name, float("nan"))
        extra = round_extra(t)
        if host and name in host:
            extra["host_ms"] = host[name]
            print(f"  {case:<34} {name:<18} host {host[name]:.3f} ms to issue a call "
                  f"({t.sustained:.3f} ms a call back to back)")  # fmt: skip
        res.add(Row(case, name, t.paired, flops, b.paired, mb, sustained_ms=t.sustained,
                    baseline_sustained_ms=b.sustained, extra=extra))  # fmt: skip


# a tuning key's configuration from this GPU's own entries (``Chooser.served``'s words)
_OWN = ("shipped", "user cache", "tuned now")


def config_sources(seen: set) -> str | None:
    """One line on where the GEMM configurations picked since ``seen`` (a snapshot of
    ``CHOOSER.served``'s keys) came from, naming every key that did not come from this
    GPU's own tuned entries (another GPU's table, the nearest entry, the shape rule): a
    ratio measured on such picks is not the tuned one (run 276: a tune cut short left two
    of a variant's keys to the shape rule, seen only in the tune's log). None: no new key."""
    sources = CHOOSER.sources(seen)
    if not sources:
        return None
    counts = ", ".join(f"{len(keys)} {src}" for src, keys in sorted(sources.items()))
    others = sorted(k for src, keys in sources.items() if src not in _OWN for k in keys)
    line = f"GEMM configurations: {counts}"
    return line + ("" if not others else "; not this GPU's own: " + ", ".join(
        f"{k} ({CHOOSER.served[k]})" for k in others))  # fmt: skip


def print_config_sources(seen: set, case: str = "") -> None:
    """``config_sources(seen)`` printed as one indented line (``case: `` before it where
    given); nothing where no key was picked since ``seen``."""
    sources = config_sources(seen)
    if sources:
        print(f"  {case + ': ' if case else ''}{sources}")


def host_ms(step, n: int = 3) -> float:
    """The host's time to issue one call of ``step`` with the GPU idle at its start
    (median of n): next to the call's time, whether the host could set the pace (waits
    on a full launch queue count too, so it is an upper bound where the GPU is slower)."""
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    times = []
    for _ in range(n):
        sync()
        t0 = time.perf_counter()
        step()
        times.append((time.perf_counter() - t0) * 1e3)
    sync()
    return sorted(times)[n // 2]


def round_extra(t: Timing) -> dict:
    """A row's per-round times (JSON), with rounds > 1."""
    return {"rounds_ms": [list(r) for r in t.rounds]} if t.rounds else {}


def run_fwd_bwd_cases(out_dir: str, name: str, cases, run_case, title) -> list[Results]:
    """The forward and forward+backward tables ``<name>_fwd``, ``<name>_fwdbwd`` over
    ``cases``: ``run_case(res_fwd, res_bwd, case)`` adds each case's rows (``title(case)``
    heads its log); both tables are written to ``out_dir`` and printed."""
    res_fwd, res_bwd = Results(f"{name}_fwd"), Results(f"{name}_fwdbwd")
    for case in cases:
        print(f"== {title(case)}", flush=True)
        run_case(res_fwd, res_bwd, case)
        torch.cuda.empty_cache()
        for res in (res_fwd, res_bwd):  # after each case: a run cut short keeps what it measured
            if res.rows:
                res.write(out_dir)
    for res in (res_fwd, res_bwd):
        res.write(out_dir)
        print(res.table())
    return [res_fwd, res_bwd]


def rand_bf16(*shape, scale=1.0):
    """Benchmark data: standard normal (times ``scale``) in bf16 on the GPU."""
    return (torch.randn(*shape, device="cuda") * scale).to(torch.bfloat16)


def rel_error(ours: torch.Tensor, ref: torch.Tensor) -> float:
    """Relative Frobenius error, for the benchmarks' sanity checks against PyTorch (the
    tests hold the real fp64 bounds)."""
    return ((ours.float() - ref.float()).norm() / ref.float().norm()).item()


def check_to_eager(names, got, ref, tol: float = 3e-2, show: str | None = None) -> dict:
    """Relative differences of the tensors ``got`` to eager's ``ref`` (both in ``names``'
    order) as {name: error}; raises past ``tol``. ``show``: print each, after that prefix."""
    errs = {}
    for name, a, b in zip(names, got, ref):
        errs[name] = err = rel_error(a, b)
        line = f"{name}: relative difference to eager {err:.2e}"
        if show is not None:
            line = f"{show} {line}"
            print(f"  {line}")
        if not err < tol:
            raise AssertionError(line)
    return errs


def no_grad_call(fn, *args):
    """``fn(*args)`` under ``torch.no_grad()`` as a callable (what the forward rows time)."""

    def run():
        with torch.no_grad():
            return fn(*args)

    return run


def with_settings(fn, **changes):
    """``fn`` run under these codetta settings (restored after), for A/B variants that
    differ only in a launcher switch (the tuner keys its choices on them)."""

    def run(*args, **kwargs):
        with settings.override(**changes):
            return fn(*args, **kwargs)

    return run


def triton_only(fn):
    """``fn`` with the sm_90 ping-pong mainloop left out of the tuner's choice: every GEMM
    on the portable mainloop (A/B variant)."""
    return with_settings(fn, pingpong=False)


def cpu_overhead_us(fn, calls: int = 300, collect: bool = True) -> float:
    """Host time per call of fn when the GPU is not the bottleneck (tiny problem). With
    ``collect``, a full garbage collection before the timed calls: what the setup left to
    collect (the warm-up's compiles make many objects at once, which can bring the
    collector's next full pass, ~0.17 s on a CPU with torch and Triton loaded, due among
    the timed calls) is not charged to them; the collector stays on, so the calls' own
    collections are (NOTES.md, "Session 48")."""
    for _ in range(10):
        fn()
    torch.cuda.synchronize()
    if collect:
        gc.collect()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    return (t1 - t0) / calls * 1e6


def profile_calls(fn, calls: int, title: str, rows: int = 30, sync_each: bool = False) -> None:
    """cProfile ``calls`` calls of ``fn`` (the GPU's queue drained before and after, and
    after each call with ``sync_each``) and print where the host's time went
    (``print_profile``)."""
    import cProfile

    torch.cuda.synchronize()
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(calls):
        fn()
        if sync_each:
            torch.cuda.synchronize()
    torch.cuda.synchronize()
    prof.disable()
    print_profile(prof, title, rows)


def print_profile(prof, title: str, rows: int = 30) -> None:
    """A cProfile ``prof``'s top ``rows`` functions, by own time then by cumulative time."""
    import io
    import pstats

    for key in ("tottime", "cumulative"):
        buf = io.StringIO()
        pstats.Stats(prof, stream=buf).sort_stats(key).print_stats(rows)
        text = buf.getvalue()
        print(f"== {title}, by {key}")
        print(text[text.find("ncalls") :])


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
    def __init__(self, name: str, baseline: str = "cuBLAS GEMM-only time"):
        self.name = name
        self.baseline = baseline  # what the ratios divide by
        self.rows: list[Row] = []
        self.env = env_info()

    @classmethod
    def load(cls, path: str) -> Results:
        """The results a ``write`` left in ``path`` (its .json): name from the file name,
        the environment it was measured in, every row with its paired and sustained times.
        (A file written before the baseline's label was stored gets the default label.)"""
        with open(path) as f:
            data = json.load(f)
        res = cls(os.path.basename(path).removesuffix(".json"), data.get("baseline", "cuBLAS GEMM-only time"))
        res.env = dict(data["env"])
        names = {f.name for f in fields(Row)}
        res.rows = [Row(**{k: v for k, v in r.items() if k in names}) for r in data["rows"]]
        return res

    def add(self, row: Row) -> Row:
        self.rows.append(row)
        print(
            f"  {row.case:<34} {row.variant:<18} {row.ms:8.3f} ms  {row.tflops:6.0f} TFLOP/s  "
            f"x{row.ratio:.3f} paired, x{row.ratio_sustained:.3f} sustained",
            flush=True,
        )
        return row

    def table(self) -> str:
        """The ratios under both timing methods, one block each."""
        variants = list(dict.fromkeys(r.variant for r in self.rows))
        cases = list(dict.fromkeys(r.case for r in self.rows))
        by = {(r.case, r.variant): r for r in self.rows}
        w = max([16] + [len(v) + 2 for v in variants])
        lines = [f"{self.name}: time / {self.baseline} ({self.env['gpu']}, commit {self.env['commit']})"]
        for method, attr in (("paired", "ratio"), ("sustained", "ratio_sustained")):
            lines.append(f"{'[' + method + ']':<34}" + "".join(f"{v:>{w}}" for v in variants))
            for c in cases:
                cells = [
                    f"{getattr(by[(c, v)], attr):>{w}.3f}" if (c, v) in by else f"{'-':>{w}}"
                    for v in variants
                ]
                lines.append(f"{c:<34}" + "".join(cells))
            # over the cases every variant ran (a variant left out of one, e.g. out of
            # memory, would otherwise be averaged over other cases than its neighbours)
            common = [c for c in cases if all((c, v) in by for v in variants)]
            if common:
                gm = [geomean(getattr(by[(c, v)], attr) for c in common) for v in variants]
                label = "geomean" if len(common) == len(cases) else f"geomean ({len(common)} cases all ran)"
                lines.append(f"{label:<34}" + "".join(f"{g:>{w}.3f}" for g in gm))
        ab = self.shipped_vs_tuned()
        if ab:
            lines.append(ab)
        return "\n".join(lines)

    def shipped_vs_tuned(self) -> str:
        """Where codetta:shipped and a tuned A/B variant ran: per case, shipped's time / each
        tuned variant's under each method, and the largest (issue 11: within 1.02); ""
        otherwise."""
        by = {(r.case, r.variant): r for r in self.rows}
        variants = list(dict.fromkeys(r.variant for r in self.rows))
        tuned = [v for v in variants if v.startswith("codetta:tuned")]
        cases = [c for c in dict.fromkeys(r.case for r in self.rows)
                 if (c, "codetta:shipped") in by and any((c, t) in by for t in tuned)]  # fmt: skip
        if not cases:
            return ""
        blocks = []
        for t in tuned:
            label = "tuned" if t == "codetta:tuned" else t.split(":")[1]
            lines = [f"{'[shipped / ' + label + ']':<34}{'paired':>10}{'sustained':>10}"]
            worst = 0.0
            for c in cases:
                if (c, t) not in by:
                    continue
                s, q = by[(c, "codetta:shipped")], by[(c, t)]
                a, b = s.ms / q.ms, s.sustained_ms / q.sustained_ms
                worst = max(worst, a, b)
                lines.append(f"{c:<34}{a:>10.3f}{b:>10.3f}")
            lines.append(f"{'largest':<34}{worst:>10.3f}")
            blocks.append("\n".join(lines))
        return "\n".join(blocks)

    def markdown(self) -> str:
        """The table for a README: each cell 'paired / sustained'."""
        variants = list(dict.fromkeys(r.variant for r in self.rows))
        cases = list(dict.fromkeys(r.case for r in self.rows))
        by = {(r.case, r.variant): r for r in self.rows}
        out = ["| case | " + " | ".join(variants) + " |", "|---" * (len(variants) + 1) + "|"]
        for c in cases:
            cells = [f"{by[(c, v)].ratio:.3f} / {by[(c, v)].ratio_sustained:.3f}" if (c, v) in by else "-"
                     for v in variants]  # fmt: skip
            out.append(f"| {c} | " + " | ".join(cells) + " |")
        return "\n".join(out)

    def write(self, out_dir: str) -> None:
        os.makedirs(out_dir, exist_ok=True)
        base = os.path.join(out_dir, self.name)
        recs = [
            {
                **asdict(r),
                "tflops": r.tflops,
                "ratio": r.ratio,
                "ratio_sustained": r.ratio_sustained,
                **self.env,
            }
            for r in self.rows
        ]
        with open(base + ".json", "w") as f:
            json.dump({"env": self.env, "baseline": self.baseline, "rows": recs}, f, indent=1)
        if recs:
            with open(base + ".csv", "w", newline="") as f:
                w = csv.DictWriter(f, fieldnames=[k for k in recs[0] if k != "extra"])
                w.writeheader()
                for r in recs:
                    w.writerow({k: v for k, v in r.items() if k != "extra"})
        with open(base + ".txt", "w") as f:
            f.write(self.table() + "\n")
        with open(base + ".md", "w") as f:
            f.write(self.markdown() + "\n")
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
        fig, axes = plt.subplots(1, 2, figsize=(max(8, 2.4 * len(cases)), 4.4), sharey=True)
        width = 0.8 / len(variants)
        values = [x for r in self.rows for x in (r.ratio, r.ratio_sustained) if math.isfinite(x)]
        # ratios differ by a few percent: the axis starts just below the lowest bar, each bar labelled
        low = max(0.0, min(values + [1.0]) - 0.1)
        for ax, (method, attr) in zip(axes, (("paired", "ratio"), ("sustained", "ratio_sustained"))):
            by = {(r.case, r.variant): getattr(r, attr) for r in self.rows}
            for i, v in enumerate(variants):
                xs = [j + i * width for j, c in enumerate(cases) if (c, v) in by]
                ys = [by[(c, v)] for c in cases if (c, v) in by]
                bars = ax.bar(xs, [y - low for y in ys], width, bottom=low, label=v)
                ax.bar_label(bars, labels=[f"{y:.3f}" for y in ys], fontsize=5, rotation=90, padding=2)
            ax.axhline(1.0, color="k", lw=0.8)
            ax.set_ylim(low, max(values + [1.0]) * 1.06)
            ax.set_xticks([j + 0.4 - width / 2 for j in range(len(cases))])
            ax.set_xticklabels(cases, rotation=30, ha="right", fontsize=8)
            ax.set_title(f"{method} timing", fontsize=9)
        axes[0].set_ylabel(f"time / {self.baseline}", fontsize=8)
        fig.legend(*axes[0].get_legend_handles_labels(), loc="lower center", ncol=len(variants), fontsize=7,
                   frameon=False)  # fmt: skip
        fig.suptitle(f"{self.name} on {self.env['gpu']} ({self.env['commit']})", fontsize=9)
        fig.tight_layout(rect=(0, 0.06, 1, 1))
        fig.savefig(path, dpi=120)
        plt.close(fig)
