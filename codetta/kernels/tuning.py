"""Config selection: the autotuner, its on-disk cache and the per-shape memo.

The cache is one JSON file of plain data (no code, no pickles) keyed by GPU
name, triton version and codetta version. A file that does not parse, holds
values outside the known configuration space, or was written for another GPU
or version is ignored with a warning and overwritten on the next save.
"""

from __future__ import annotations

import functools
import itertools
import json
import os
import sys
import tempfile
import time
import types
import warnings
from dataclasses import asdict
from pathlib import Path

import torch
import triton

from .._version import __version__
from . import configs, device, precompile, timing
from .compile_pool import compiling_in_children
from .configs import Config, config_from_dict
from .engines import PINGPONG, TRITON
from .memo import Memo
from .operands import GemmCall
from .persistent import capturing
from .program import Kind
from .settings import SETTINGS

CACHE_FORMAT = 3


class TuneCache:
    """Plain-data cache of tuned configs, persisted as JSON between processes."""

    def __init__(self, path: Path, identity: dict):
        self.path = path
        self.identity = identity
        self.entries: dict[str, Config] = {}
        self._load()

    def _load(self):
        if not self.path.exists():
            return
        try:
            data = json.loads(self.path.read_text())
            if not isinstance(data, dict) or data.get("format") != CACHE_FORMAT:
                raise ValueError("unknown format")
            if data.get("identity") != self.identity:
                warnings.warn(
                    f"codetta: tuning cache {self.path} was written for {data.get('identity')}, "
                    f"not {self.identity}; ignoring it",
                    stacklevel=3,
                )
                return
            entries = data.get("entries")
            if not isinstance(entries, dict):
                raise ValueError("entries is not a mapping")
            self.entries = {str(k): config_from_dict(v) for k, v in entries.items()}
        except (ValueError, TypeError, OSError) as exc:
            self.entries = {}
            warnings.warn(f"codetta: ignoring unreadable tuning cache {self.path}: {exc}", stacklevel=3)

    def get(self, key: str) -> Config | None:
        return self.entries.get(key)

    def put(self, key: str, cfg: Config) -> None:
        self.entries[key] = cfg
        data = {
            "format": CACHE_FORMAT,
            "identity": self.identity,
            "entries": {k: asdict(v) for k, v in sorted(self.entries.items())},
        }
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=self.path.parent, suffix=".tmp")
            with os.fdopen(fd, "w") as f:
                json.dump(data, f, indent=1)
            os.replace(tmp, self.path)
        except OSError as exc:
            warnings.warn(f"codetta: could not save tuning cache {self.path}: {exc}", stacklevel=3)


def tune(key: str, candidates: list[Config], prepare, measure) -> Config:
    """Time each candidate's launch ``prepare(cfg)()``; return the fastest."""
    times = tune_times(key, candidates, prepare, measure)
    return min(times, key=times.get)


# candidates within this factor of the scouting round's best (per mainloop) are timed in full
SCOUT_KEEP = 1.10
PROGRESS_S = 10.0  # a key whose compiles and first runs took longer prints a line before its timing


def tune_times(key: str, candidates: list[Config], prepare, measure, scout=None) -> dict[Config, float]:
    """Time each candidate's launch ``prepare(cfg)()``; return ``{cfg: ms}`` of those that ran.

    Every candidate is compiled (and run once) first; ``measure`` then times all
    the runnable ones together, ``{cfg: fn} -> {cfg: ms}`` (on the GPU:
    ``timing.paired_ms``, candidates alternating call by call under sustained load,
    so a config timed after an idle compile pause does not look faster than it
    is in training). A candidate that fails to compile or launch (shared memory,
    registers) is skipped; if none runs, the error of the first is raised. ``scout``
    (same contract as ``measure``), if given, times all of them briefly first and
    only those within ``SCOUT_KEEP`` of the best of their own mainloop (portable or
    ping-pong) go on to ``measure``.
    """
    print(f"codetta: tuning {key} over {len(candidates)} configs ...", file=sys.stderr, flush=True)
    t0 = time.perf_counter()
    compile_concurrently(candidates, prepare)
    t1 = time.perf_counter()
    fns, first_err = {}, None
    for cfg in candidates:
        try:
            fn = prepare(cfg)
            sync = SETTINGS.tune_verbose and torch.cuda.is_available()
            if sync:  # (verbose: each first run's wall time, so a very slow candidate shows)
                torch.cuda.synchronize()
            t = time.perf_counter()
            fn()
            fns[cfg] = fn
            if sync:
                torch.cuda.synchronize()
                print(f"codetta:   {cfg.short():<28} first run {time.perf_counter() - t:.3f} s",
                      file=sys.stderr, flush=True)  # fmt: skip
        except Exception as exc:  # noqa: BLE001 - out-of-resources is expected for some configs
            first_err = first_err or exc
    if not fns:
        raise RuntimeError(f"codetta: no configuration of {key} could run") from first_err
    t2 = time.perf_counter()
    if t2 - t0 > PROGRESS_S:  # a long key (a large GEMM, a cold compile): say where it is
        print(f"codetta:   {key}: compiled in {t1 - t0:.1f} s, {len(fns)} of {len(candidates)} ran once in "
              f"{t2 - t1:.1f} s; timing them ...", file=sys.stderr, flush=True)  # fmt: skip
    if scout is not None and len(fns) > 3:
        # a short paired round first: candidates clearly behind the best of their own
        # mainloop drop out before the long one. Each mainloop's best goes on: the two differ
        # under sustained load (the ping-pong draws more power; on an H100 its sustained
        # penalty, NOTES.md), which ``--method both`` / ``sustained`` judge after the scout,
        # and the portable one's best is the CODETTA_PINGPONG=0 key's pick (``Chooser.picks``)
        quick = scout(fns)
        best = {}
        for c, ms in quick.items():
            best[c.pingpong] = min(ms, best.get(c.pingpong, ms))
        fns = {c: fn for c, fn in fns.items() if quick[c] <= SCOUT_KEEP * best[c.pingpong]}
    t3 = time.perf_counter()
    med = measure(fns)
    t4 = time.perf_counter()
    if SETTINGS.tune_verbose:
        for cfg, ms in med.items():
            print(f"codetta:   {cfg.short():<28} {ms:.4f} ms", file=sys.stderr, flush=True)
    best = min(med, key=med.get)
    print(f"codetta: tuned {key}: {best.short()} ({med[best]:.3f} ms; host s: compile {t1 - t0:.1f}, "
          f"first runs {t2 - t1:.1f}, scout {t3 - t2:.1f}, timing {t4 - t3:.1f} of {len(fns)})",
          file=sys.stderr, flush=True)  # fmt: skip
    return med


def compile_concurrently(candidates: list[Config], prepare) -> None:
    """Compile every candidate first, all at once in forked child processes
    (``compile_pool.py``); failures surface at the first real run. ``prepare(cfg)`` must
    accept ``warmup=True`` (compile only); others are skipped."""
    if device.interpreting() or len(candidates) < 2 or precompile.active():
        return  # (inside codetta.precompile no candidate is timed: the rule's pick compiles there)
    with compiling_in_children(min(len(candidates), SETTINGS.compile_workers or 16), ignore_errors=True):
        for cfg in candidates:
            try:
                prepare(cfg)(warmup=True)
            except Exception:  # noqa: BLE001 - a candidate that cannot compile fails again in its real run
                pass


# A K this long gives a light epilogue's tile enough K loop that the portable mainloop's
# serial epilogue costs little (run 54: store, accumulate, residual_rms at K >= 8192
# ran at 0.87-0.95x cuBLAS there, at K 512-2048 1.2-1.6x)
LONG_K = 4096


def pingpong_pays(call) -> bool:
    """Whether overlapping the epilogue with the next tile's K loop is worth the
    ping-pong mainloop's extra shared-memory traffic (and power): a tile input, a paired
    weight, a float32 ring, a per-row table or gathered index, a row log-sum-exp, pick
    or column sums, or a short K. Measured in a Llama-3.2-1B step (run 54, NOTES.md).
    ``call``: a GemmCall or a RecordedCall (its program, dtype and K)."""
    prog = call.program
    heavy_in = (Kind.TILE, Kind.PAIRED_WEIGHT, Kind.ROW_TABLE, Kind.PER_ROW_INDEX)
    return (
        any(op.kind in heavy_in for op in prog.caller_inputs)
        or any(op.kind in (Kind.ROW_LSE, Kind.ROW_PICK, Kind.COL_SUM) for op in prog.outputs)
        or PINGPONG.ring_dtype(prog, call.dtype) == torch.float32
        or call.k_total < LONG_K
    )


def policy_allows(call) -> bool:
    """Whether the ``pingpong_policy`` setting lets the call on the ping-pong mainloop
    (a GemmCall or a RecordedCall)."""
    return SETTINGS.pingpong_policy == "all" or pingpong_pays(call)


def pingpong_allowed(call: GemmCall) -> bool:
    """Whether the ping-pong mainloop's configurations are candidates for the call: it
    can run it, the ``pingpong`` setting is on, and the policy setting agrees."""
    if not SETTINGS.pingpong or PINGPONG.unsupported(call) is not None:
        return False
    return policy_allows(call)


def candidates(call: GemmCall, pingpong: bool | None = None) -> list[Config]:
    """The configurations the tuner tries for a call: the portable mainloop's, then the
    ping-pong mainloop's where ``pingpong`` (default: ``pingpong_allowed``) says so."""
    allow = pingpong_allowed(call) if pingpong is None else pingpong and PINGPONG.unsupported(call) is None
    cands = program_candidates(call.program, allow)
    # M or N parts: each tile within one part (launch.check_parts)
    return [c for c in cands if configs.tiles_fit_parts(c, call.widths, call.heights)]


def program_candidates(program, pingpong: bool) -> list[Config]:
    """The portable mainloop's configurations of ``program``, then, with ``pingpong``, the
    ping-pong mainloop's (under the current settings; ``candidates`` narrows them to a call)."""
    cands = list(TRITON.candidates(program))
    return cands + list(PINGPONG.candidates(program)) if pingpong else cands


def rule_config(call: GemmCall, cands: list[Config]) -> Config:
    """A configuration without timing anything, from the shape (what the tuner picked on an
    H200 in runs 25-27, NOTES.md): the ping-pong mainloop with its finest epilogue split
    once there are enough 128x128 tiles for both consumers of every SM; the portable
    mainloop's 128x256 flattened tiles for very wide outputs (a vocabulary); two
    programs per SM on 128x128 tiles when tiles are few; else the first candidate."""
    pingpong = [c for c in cands if c.pingpong]
    portable = [c for c in cands if not c.pingpong]
    tiles = -(-call.M // 128) * -(-call.N // 128)
    sms = device.num_sms(call.device.index or 0) if call.device.type == "cuda" else 132

    def first(pred):
        return next((c for c in portable if pred(c)), None)

    if call.N >= 65536:
        pick = first(lambda c: (c.block_m, c.block_n, c.epi_split, c.flatten) == (128, 256, 2, True))
        if pick is not None:
            return pick
    if pingpong and tiles >= 2 * sms:
        # (at the candidates' own row group: configs.with_row_groups appends other groups)
        return [c for c in pingpong if c.group_m == pingpong[0].group_m][-1]
    if tiles < 2 * sms:
        pick = first(lambda c: c.occupancy == 2)
        if pick is not None:
            return pick
    return cands[0]


def _measure(fns: dict, seconds: float = 1.0) -> dict:
    # paired (default): candidates alternate call by call, so each is timed at the same
    # clock: the cycles it takes. "sustained": each candidate in blocks of its own after
    # settling, so at the clock its own power draw sets at the 700 W cap (the step's GEMMs
    # run at the clock the step's power sets: energy, not cycles, decides there). Blocks
    # without the settling run picked configs that lost 3-10 % (NOTES.md, runs 2-3 of
    # Engine II); settled blocks agree to ~0.5 % between identical variants (run 95).
    # "both": each candidate scored by the worse of its two ratios to the best candidate of
    # each method (a ratio counts only if it holds under both timings), reported as that
    # factor times the best paired time. Run 96: sustained picks gained 1-2 % sustained
    # and lost 1-4.5 % paired against the paired picks.
    torch.cuda.synchronize()
    method = SETTINGS.tune_method
    paired = sustained = None
    if method in ("paired", "both"):
        paired = timing.paired_ms(
            fns, min_s=seconds, min_cycles=7 if seconds >= 1.0 else 5, warm_s=seconds / 2
        )
    if method in ("sustained", "both"):
        sustained = timing.sustained_ms(
            fns, block_ms=SUSTAINED_BLOCK_MS, blocks=3, warm_s=0.1, settle_ms=SUSTAINED_SETTLE_MS
        )
    if paired is None or sustained is None:
        return paired if sustained is None else sustained
    return both_scores(paired, sustained)


def both_scores(paired: dict, sustained: dict) -> dict:
    """``{cfg: best paired ms x max(paired / best paired, sustained / best sustained)}``."""
    bp, bs = min(paired.values()), min(sustained.values())
    return {c: bp * max(paired[c] / bp, sustained[c] / bs) for c in paired}


SUSTAINED_BLOCK_MS, SUSTAINED_SETTLE_MS = 60.0, 120.0  # ~0.54 s per candidate timed in full


def _scout(fns: dict) -> dict:
    torch.cuda.synchronize()
    return timing.paired_ms(fns, min_s=0.05, min_cycles=2, max_cycles=3, warm_s=0.05)


_UNSEEN = object()  # (a memo's miss, where None is a value)


class Chooser:
    """Picks a call's configuration, first hit wins: the per-process memo; the user's
    tuning cache (``python -m codetta tune``, or earlier tuning on the hot path); the
    table shipped for this GPU (``kernels/tuned/``); tuning now, if ``CODETTA_AUTOTUNE=1``
    (outside CUDA graph capture); the nearest entry of that table or cache (same
    program, dtype and layout; closest shape buckets); the shape rule (``rule_config``).
    ``clear()`` forgets the memo and reloads the caches (tests). ``served`` records, per
    tuning key picked in this process, where its configuration came from (``sources``)."""

    def __init__(self):
        self._chosen = Memo()  # (keyed on call shapes: bounded, ``memo.py``)
        # the nearest entry of an untuned tuning key (or None), looked up once per key: a
        # scan of the whole table (~3 ms on an H100's host), which a new token count each
        # call (batches padded to their longest sequence) would otherwise pay on every call
        self._near = Memo()
        self._caches: dict = {}
        self._shipped: dict = {}
        self.generation = 0  # bumped by clear(): what was decided from the memo is stale
        # key -> "user cache", "shipped", "shipped (<GPU>'s)", "tuned now", "nearest entry",
        # "ping-pong preference" or "shape rule" (the latest pick of each key)
        self.served: dict[str, str] = {}

    def sources(self, seen=frozenset()) -> dict[str, list[str]]:
        """{source: [keys]} of ``served``, less the keys in ``seen`` (a snapshot taken before
        a benchmark case): which configurations a run took from its GPU's own entries and
        which it did not (another GPU's table, the nearest entry, the shape rule), for a
        benchmark to say so beside its numbers."""
        out: dict[str, list[str]] = {}
        for key, source in self.served.items():
            if key not in seen:
                out.setdefault(source, []).append(key)
        return out

    def clear(self) -> None:
        self._chosen.clear()
        self._near.clear()
        self._caches.clear()
        self._shipped.clear()
        self.generation += 1

    def cache(self, device_index: int) -> TuneCache:
        """The user's tuning cache for this device, in ``SETTINGS.cache_dir`` (one per
        folder: an A/B variant may tune into a folder of its own)."""
        key = (device_index, SETTINGS.cache_dir)
        if key not in self._caches:
            identity = {
                "gpu": device.name(device_index),
                "triton": triton.__version__,
                "codetta": __version__,
            }
            self._caches[key] = TuneCache(SETTINGS.cache_dir / "tuning.json", identity)
        return self._caches[key]

    def shipped(self, device_index: int) -> dict:
        """The shipped table's entries for this device's GPU ({} if none fits, or
        ``CODETTA_SHIPPED=0``)."""
        if not SETTINGS.shipped:
            return {}
        if device_index not in self._shipped:
            self._shipped[device_index] = shipped_table(
                device.name(device_index), device.capability(device_index), device.num_sms(device_index)
            )
        return self._shipped[device_index]

    @staticmethod
    def key(call, pingpong: bool) -> str:
        """The tuning key of a call (anything with program, dtype, a_t, b_t, M, N, K)."""
        prog = call.program
        # the body's source hash keeps two programs of one name (or an edited body) apart
        parts = [f"{prog.name}@{prog.source_key}", str(call.dtype).removeprefix("torch."),
                 ("t" if call.a_t else "n") + ("t" if call.b_t else "n")]  # fmt: skip
        parts += [str(configs.shape_bucket(x)) for x in (call.M, call.N, call.k_total)]
        return "|".join(parts) + ("" if pingpong else "|no-pingpong")

    def choose(self, call: GemmCall, prepare) -> Config:
        """``prepare(cfg) -> fn`` makes a runnable launch of the call for tuning."""
        if device.interpreting():
            return configs.interpreter_config(call.program.sub_tile_width)
        pp = pingpong_allowed(call)
        # (settings that change the choice: the shipped table, the cache folder, tuning on
        # the hot path; A/B variants take turns under their own, SETTINGS.generation)
        memo = (call.program, call.dtype, call.a_t, call.b_t, call.M, call.N, call.k_total, call.device, pp,
                SETTINGS.generation)  # fmt: skip
        cfg = self._chosen.get(memo)
        if cfg is None:
            cfg = self._chosen[memo] = self._pick(call, prepare, pp)
        return cfg

    def known(
        self, call: GemmCall, pp: bool, cands: list[Config], lent: bool = True
    ) -> tuple[Config | None, str]:
        """The tuned configuration of the call's key, and where it came from ("user cache",
        "shipped", or "shipped (<GPU>'s)" from a similar GPU's table; ``lent=False``: not
        those), or (None, "")."""
        key = self.key(call, pp)
        index = call.device.index or 0
        for source, entries in (("user cache", self.cache(index).entries), ("shipped", self.shipped(index))):
            cfg = entries.get(key)
            if cfg is not None and cfg in cands:
                if isinstance(entries, ShippedEntries) and key in entries.borrowed:
                    if not lent:
                        continue
                    source = entries.source(key)
                return cfg, source
        return None, ""

    def tune(self, call: GemmCall, prepare, pp: bool, cands: list[Config], seconds: float = 1.0) -> Config:
        """Time every candidate now (``seconds`` of paired timing); store the winner in the
        user's cache."""
        cache = self.cache(call.device.index or 0)
        key = self.key(call, pp)
        times = tune_times(key, cands, prepare, lambda fns: _measure(fns, seconds), _scout)
        for k, cfg in self.picks(call, pp, times).items():
            cache.put(k, cfg)
        self._chosen.clear()  # choices made before may differ now
        self._near.clear()
        self.generation += 1
        return min(times, key=times.get)

    def picks(self, call: GemmCall, pp: bool, times: dict) -> dict:
        """``{key: Config}`` a sweep's times (``{cfg: ms}``) settle: the fastest under the
        call's key and, when the sweep ran both mainloops, the fastest portable one under
        the CODETTA_PINGPONG=0 key too (A/B runs)."""
        out = {self.key(call, pp): min(times, key=times.get)}
        portable = {c: ms for c, ms in times.items() if not c.pingpong}
        if pp and portable:
            out[self.key(call, False)] = min(portable, key=portable.get)
        return out

    def untuned(self, call: GemmCall, pp: bool, cands: list[Config]) -> Config:
        """The choice when the key is neither known nor tuned now: the first ping-pong
        candidate under the ``prefer_pingpong`` setting, else the nearest entry of the table
        or the cache, else the shape's rule. The nearest is looked for under the call's own
        program and dtype, then the program it is ``tuned_like``, then the other 2-byte float
        (fp16 calls take bf16 picks, as the shipped table has bf16 alone: the tiles, stages
        and epilogues are the same for both), the first of those at the least distance."""
        return self._untuned(call, pp, cands)[0]

    def _untuned(
        self, call: GemmCall, pp: bool, cands: list[Config], remember: bool = False
    ) -> tuple[Config, str]:
        """``untuned``'s choice and which rule made it (``served``'s words). ``remember``:
        the nearest entry found (or its absence) is kept per tuning key and candidates
        until ``clear()`` or a tuning changes the entries (``_pick``; the table and cache
        change no other way in a run)."""
        pingpong = [c for c in cands if c.pingpong]
        if SETTINGS.prefer_pingpong and pingpong:
            return pingpong[0], "ping-pong preference"
        index = call.device.index or 0
        memo = (self.key(call, pp), tuple(cands), index, SETTINGS.generation) if remember else None
        near = self._near.get(memo, _UNSEEN) if remember else _UNSEEN
        if near is _UNSEEN:
            near = self._nearest_entry(call, pp, cands, index)
            if remember:
                self._near[memo] = near
        return (near, "nearest entry") if near is not None else (rule_config(call, cands), "shape rule")

    def _nearest_entry(self, call: GemmCall, pp: bool, cands: list[Config], index: int) -> Config | None:
        """``untuned``'s nearest entry of the table or the cache, or None. Looked for in the
        call's own layout first; where that layout has no entry at all, in the program's
        other layouts (run 323, an H100: the plain GEMM in layout nn, which no model step
        runs, took the shape rule's ping-pong pick, 15-20 % slower than the tuned one, a
        flattened 128x256 tile, the layout nt's entries at those shapes)."""
        entries = {**self.shipped(index), **self.cache(index).entries}
        programs = [call.program] + ([call.program.tuned_like] if call.program.tuned_like is not None else [])
        twins = {torch.float16: torch.bfloat16, torch.bfloat16: torch.float16}
        dtypes = [call.dtype] + ([twins[call.dtype]] if call.dtype in twins else [])
        own = (call.a_t, call.b_t)
        others = [lay for lay in ((False, True), (True, True), (False, False), (True, False)) if lay != own]
        for layouts in ([own], others):
            near, dist = None, None
            for (a_t, b_t), dtype, program in itertools.product(layouts, dtypes, programs):
                stand_in = types.SimpleNamespace(program=program, dtype=dtype, a_t=a_t, b_t=b_t,
                                                 M=call.M, N=call.N, k_total=call.k_total)  # fmt: skip
                other, other_dist = _nearest(self.key(stand_in, pp), cands, entries)
                if other is not None and (near is None or other_dist < dist):
                    near, dist = other, other_dist
            if near is not None:
                return near
        return None

    def _pick(self, call: GemmCall, prepare, pp: bool) -> Config:
        cands = candidates(call, pingpong=pp)
        if not cands:  # (an operator asks launch.parts_fit first; this is for a direct call)
            raise ValueError(
                f"program {call.program.name!r} has no configuration on this GPU for N parts {call.widths} / "
                f"M parts {call.heights} (every boundary between parts must fall on a tile edge)"
            )
        key = self.key(call, pp)
        cfg, source = self.known(call, pp, cands, lent=False)
        if cfg is None:
            # (another GPU's pick: tuned anew when tuning is on)
            cfg, source = self.known(call, pp, cands)
            if SETTINGS.autotune and not (capturing(call.device) if cfg is not None else _capturing(call)):
                cfg, source = self.tune(call, prepare, pp, cands, SETTINGS.tune_seconds), "tuned now"
            elif cfg is None:
                cfg, source = self._untuned(call, pp, cands, remember=True)
        self.served[key] = source
        return cfg


def nearest(key: str, cands: list[Config], entries: dict) -> Config | None:
    """The entry of the same program, dtype, layout and mainloop choice whose shape buckets
    are closest to ``key``'s (summed log2 distance over M, N, K), if its config is a
    candidate."""
    return _nearest(key, cands, entries)[0]


def _nearest(key: str, cands: list[Config], entries: dict) -> tuple[Config | None, int | None]:
    """``nearest``'s entry and its distance (None, None without one)."""
    head, dims, tail = _split_key(key)
    best, best_d = None, None
    for k, cfg in entries.items():
        h, ds, t = _split_key(k)
        if h != head or t != tail or ds is None or cfg not in cands:
            continue
        dist = sum(abs(a.bit_length() - b.bit_length()) for a, b in zip(dims, ds))
        if best_d is None or dist < best_d:
            best, best_d = cfg, dist
    return best, best_d


@functools.lru_cache(maxsize=8192)  # (the table's keys, split once each)
def _split_key(key: str):
    parts = key.split("|")
    try:
        return "|".join(parts[:3]), tuple(int(x) for x in parts[3:6]), "|".join(parts[6:])
    except ValueError:
        return key, None, ""


SHIPPED_DIR = Path(__file__).parent / "tuned"


def _shipped_files() -> list[tuple[Path, dict, dict]]:
    """(path, identity, raw entries) of every shipped table that loads; any other warns."""
    tables = []
    for path in sorted(SHIPPED_DIR.glob("*.json")):
        try:
            data = json.loads(path.read_text())
            ident = data["identity"]
            if data.get("format") != CACHE_FORMAT or not isinstance(data.get("entries"), dict):
                raise ValueError("unknown format")
            tables.append((path, ident, data["entries"]))
        except (ValueError, KeyError, TypeError, OSError) as exc:
            warnings.warn(f"codetta: ignoring shipped table {path}: {exc}", stacklevel=5)
    return tables


def shipped_gpus() -> dict[str, dict]:
    """{GPU name: its shipped table's identity (capability, num_sms, triton)}."""
    return {str(ident.get("gpu", "")): ident for _, ident, _ in _shipped_files()}


def _series(version) -> str:
    return ".".join(str(version).split(".")[:2])


def triton_series() -> str:
    """This process's Triton minor series ("3.6"): a table tuned under another is not read."""
    return _series(triton.__version__)


def shipped_table(gpu: str, capability: tuple, num_sms: int) -> dict:
    """Entries of the tables shipped for ``gpu``'s kind (``kernels/tuned/<gpu>.json``) and for
    GPUs of the same architecture and SM count (H100 SXM and H200 share both): the GPU's own
    table wins where it has a key, a similar GPU's pick fills in the rest (an H100 takes its
    own picks where it has them, the H200's elsewhere: NOTES.md, runs 217-220). Tables tuned
    under another Triton minor version are skipped. {} if none fits."""
    tables = _shipped_files()
    exact = [t for t in tables if t[1].get("gpu") == gpu]
    similar = [t for t in tables if t[1].get("gpu") != gpu
               and list(t[1].get("capability", ())) == list(capability)
               and t[1].get("num_sms") == num_sms]  # fmt: skip
    out = ShippedEntries()
    for path, ident, entries in similar + exact:  # (the GPU's own table last: its picks win)
        if _series(ident.get("triton", "")) != triton_series():
            continue  # tuned under another Triton: its picks may not hold
        for k, v in entries.items():
            try:
                out[str(k)] = config_from_dict(v)
            except (ValueError, TypeError):
                warnings.warn(f"codetta: shipped table {path}: ignoring entry {k!r}", stacklevel=4)
                continue
            if ident.get("gpu") == gpu:
                out.borrowed.pop(str(k), None)
            else:
                out.borrowed[str(k)] = str(ident.get("gpu"))
    return out


class ShippedEntries(dict):
    """``shipped_table``'s {key: Config}, with ``borrowed``: {key: the GPU whose table gave
    the entry} for those that come from a similar GPU's table, not the GPU's own."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.borrowed: dict[str, str] = {}

    def source(self, key: str) -> str:
        """How ``Chooser.known`` names where the key's entry came from."""
        gpu = self.borrowed.get(key)
        return "shipped" if gpu is None else f"shipped ({gpu.removeprefix('NVIDIA ')}'s)"


def _capturing(call: GemmCall) -> bool:
    """Inside CUDA graph capture nothing may synchronize, so nothing is tuned there: an
    untuned shape takes the nearest or the rule's configuration (tune it in a warm-up step
    before capturing)."""
    if capturing(call.device):
        warnings.warn(
            f"codetta: {call.program.name} {call.M}x{call.N}x{call.K} first seen during CUDA graph "
            "capture: it runs untuned (run one step before capturing to tune it)",
            stacklevel=6,
        )
        return True
    return False


CHOOSER = Chooser()
