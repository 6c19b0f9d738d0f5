"""Config selection: the autotuner, its on-disk cache and the per-shape memo.

The cache is one JSON file of plain data (no code, no pickles) keyed by GPU
name, triton version and codetta version. A file that does not parse, holds
values outside the known configuration space, or was written for another GPU
or version is ignored with a warning and overwritten on the next save.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import warnings
from dataclasses import asdict
from pathlib import Path

import torch
import triton

from .._version import __version__
from . import configs, device, timing
from .configs import Config, config_from_dict
from .engines import PINGPONG, TRITON
from .operands import GemmCall
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


def tune_times(key: str, candidates: list[Config], prepare, measure) -> dict[Config, float]:
    """Time each candidate's launch ``prepare(cfg)()``; return ``{cfg: ms}`` of those that ran.

    Every candidate is compiled (and run once) first; ``measure`` then times all
    the runnable ones together, ``{cfg: fn} -> {cfg: ms}`` (on the GPU:
    ``timing.paired_ms``, candidates alternating call by call under sustained load,
    so a config timed after an idle compile pause does not look faster than it
    is in training). A candidate that fails to compile or launch (shared memory,
    registers) is skipped; if none runs, the error of the first is raised.
    """
    print(f"codetta: tuning {key} over {len(candidates)} configs ...", file=sys.stderr, flush=True)
    compile_concurrently(candidates, prepare)
    fns, first_err = {}, None
    for cfg in candidates:
        try:
            fn = prepare(cfg)
            fn()
            fns[cfg] = fn
        except Exception as exc:  # noqa: BLE001 - out-of-resources is expected for some configs
            first_err = first_err or exc
    if not fns:
        raise RuntimeError(f"codetta: no configuration of {key} could run") from first_err
    med = measure(fns)
    if SETTINGS.tune_verbose:
        for cfg, ms in med.items():
            print(f"codetta:   {cfg.short():<28} {ms:.4f} ms", file=sys.stderr, flush=True)
    best = min(med, key=med.get)
    print(f"codetta: tuned {key}: {best.short()} ({med[best]:.3f} ms)", file=sys.stderr, flush=True)
    return med


def compile_concurrently(candidates: list[Config], prepare) -> None:
    """Compile every candidate first, in threads (Triton's async compile mode: ptxas and
    part of the compiler run outside the GIL); failures surface at the first real run.
    ``prepare(cfg)`` must accept ``warmup=True`` (compile only); others are skipped."""
    if device.interpreting() or len(candidates) < 2:
        return
    from concurrent.futures import ThreadPoolExecutor

    from triton.runtime._async_compile import AsyncCompileMode

    workers = min(len(candidates), os.cpu_count() or 1, 16)
    with ThreadPoolExecutor(workers) as pool, AsyncCompileMode(pool, ignore_errors=True):
        for cfg in candidates:
            try:
                prepare(cfg)(warmup=True)
            except Exception:  # noqa: BLE001 - a candidate that cannot compile fails again in its real run
                pass


def candidates(call: GemmCall, pingpong: bool | None = None) -> list[Config]:
    """The configurations the tuner tries for a call: the portable mainloop's, then the
    ping-pong mainloop's where it can run (and ``pingpong``, default the setting, allows)."""
    allow = SETTINGS.pingpong if pingpong is None else pingpong
    cands = TRITON.candidates(call.program)
    if allow and PINGPONG.unsupported(call) is None:
        cands += PINGPONG.candidates(call.program)
    return cands


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
        return pingpong[-1]
    if tiles < 2 * sms:
        pick = first(lambda c: c.occupancy == 2)
        if pick is not None:
            return pick
    return cands[0]


def _measure(fns: dict) -> dict:
    # paired: candidates alternate call by call. Timing each in sustained blocks instead
    # picked configs that lost 3-10 % in the operators' own fwd+bwd under both timings
    # (NOTES.md, runs 2 and 3 of this engine)
    torch.cuda.synchronize()
    return timing.paired_ms(fns, min_s=1.0, min_cycles=7, warm_s=0.5)


class Chooser:
    """Picks a call's configuration: from the per-process memo, the tuning cache, or by
    tuning (timing every candidate). ``clear()`` forgets the memo (tests)."""

    def __init__(self):
        self._chosen: dict = {}
        self._caches: dict = {}

    def clear(self) -> None:
        self._chosen.clear()
        self._caches.clear()

    def cache(self, device_index: int) -> TuneCache:
        if device_index not in self._caches:
            identity = {
                "gpu": device.name(device_index),
                "triton": triton.__version__,
                "codetta": __version__,
            }
            self._caches[device_index] = TuneCache(SETTINGS.cache_dir / "tuning.json", identity)
        return self._caches[device_index]

    @staticmethod
    def key(call: GemmCall, pingpong: bool) -> str:
        prog = call.program
        # the body's source hash keeps two programs of one name (or an edited body) apart
        src = getattr(prog.body, "cache_key", "")[:10] + getattr(prog.sm90_body, "cache_key", "")[:6]
        parts = [f"{prog.name}@{src}" if src else prog.name, str(call.dtype).removeprefix("torch."),
                 ("t" if call.a_t else "n") + ("t" if call.b_t else "n")]  # fmt: skip
        parts += [str(configs.shape_bucket(x)) for x in (call.M, call.N, call.K)]
        return "|".join(parts) + ("" if pingpong else "|no-pingpong")

    def choose(self, call: GemmCall, prepare) -> Config:
        """``prepare(cfg) -> fn`` makes a runnable launch of the call for tuning."""
        if device.interpreting():
            return configs.INTERPRETER_CONFIG
        pp = SETTINGS.pingpong and PINGPONG.unsupported(call) is None
        memo = (call.program, call.dtype, call.a_t, call.b_t, call.M, call.N, call.K, call.device, pp)
        cfg = self._chosen.get(memo)
        if cfg is None:
            cfg = self._chosen[memo] = self._tuned(call, prepare, pp)
        return cfg

    def _tuned(self, call: GemmCall, prepare, pp: bool) -> Config:
        cands = candidates(call, pingpong=pp)
        if not SETTINGS.autotune or _capturing(call):
            pingpong = [c for c in cands if c.pingpong]
            return pingpong[0] if SETTINGS.prefer_pingpong and pingpong else rule_config(call, cands)
        cache = self.cache(call.device.index or 0)
        key = self.key(call, pp)
        cfg = cache.get(key)
        if cfg is None:
            times = tune_times(key, cands, prepare, _measure)
            cfg = min(times, key=times.get)
            cache.put(key, cfg)
            portable = {c: ms for c, ms in times.items() if not c.pingpong}
            if pp and portable:
                # one sweep over both mainloops also answers CODETTA_PINGPONG=0 (A/B runs)
                cache.put(self.key(call, False), min(portable, key=portable.get))
        return cfg


def _capturing(call: GemmCall) -> bool:
    """Inside CUDA graph capture nothing may synchronize, so nothing is tuned there: an
    untuned shape takes the rule's configuration (tune it in a warm-up step before capturing)."""
    if call.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        cache = CHOOSER.cache(call.device.index or 0)
        if cache.get(Chooser.key(call, SETTINGS.pingpong and PINGPONG.unsupported(call) is None)) is None:
            warnings.warn(
                f"codetta: {call.program.name} {call.M}x{call.N}x{call.K} first seen during CUDA graph "
                "capture: it runs untuned (run one step before capturing to tune it)",
                stacklevel=5,
            )
        return True
    return False


CHOOSER = Chooser()
