"""Kernel configurations, the autotuner and its on-disk cache.

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
from dataclasses import asdict, dataclass, fields
from pathlib import Path

CACHE_FORMAT = 2


@dataclass(frozen=True)
class Config:
    """One kernel configuration. ``epi_split``: the epilogue sees the tile in that
    many column sub-tiles; ``flatten``: Triton flattens the persistent and K loops so
    the next tile's loads start during this tile's epilogue; ``warp_specialize``:
    Triton's automatic warp specialization, a no-op on sm_90 with triton 3.6 (same
    SASS), so no shipped candidate sets it; ``occupancy``: persistent programs per SM;
    ``tail_split``: split the tiles of a last, partial wave along K into up to that
    many parts (1 = off; see ``mainloop.py``); ``pingpong``: run the sm_90 Gluon
    mainloop (``pingpong.py``: 128x128 tiles, a loader warp and two consumer
    warpgroups, ``num_warps`` per consumer) instead of the Triton one."""

    block_m: int = 128
    block_n: int = 256
    block_k: int = 64
    group_m: int = 8
    epi_split: int = 2
    num_stages: int = 3
    num_warps: int = 8
    flatten: bool = False
    warp_specialize: bool = False
    occupancy: int = 1
    tail_split: int = 1
    pingpong: bool = False

    @property
    def sub_n(self) -> int:
        return self.block_n // self.epi_split

    def short(self) -> str:
        flags = ("F" if self.flatten else "") + ("W" if self.warp_specialize else "")
        flags += f"x{self.occupancy}" if self.occupancy > 1 else ""
        flags += f"t{self.tail_split}" if self.tail_split > 1 else ""
        flags += "P" if self.pingpong else ""
        return (
            f"{self.block_m}x{self.block_n}x{self.block_k}/s{self.num_stages}w{self.num_warps}"
            f"e{self.epi_split}g{self.group_m}{flags}"
        )


_ALLOWED = {
    "block_m": {16, 32, 64, 128, 256},
    "block_n": {16, 32, 64, 128, 256},
    "block_k": {16, 32, 64, 128},
    "group_m": {1, 2, 4, 8, 16},
    "epi_split": {1, 2, 4},
    "num_stages": {1, 2, 3, 4, 5, 6},
    "num_warps": {4, 8},
    "flatten": {True, False},
    "warp_specialize": {True, False},
    "occupancy": {1, 2},
    "tail_split": {1, 2, 3, 4, 8},
    "pingpong": {True, False},
}


def config_from_dict(d: dict) -> Config:
    """Build a Config from untrusted plain data; raise ValueError if it is off."""
    if not isinstance(d, dict) or set(d) != {f.name for f in fields(Config)}:
        raise ValueError(f"not a config: {d!r}")
    for k, v in d.items():
        if type(v) not in (int, bool) or v not in _ALLOWED[k]:
            raise ValueError(f"config field {k}={v!r} is outside the known space")
    cfg = Config(**d)
    if cfg.block_n % cfg.epi_split or cfg.sub_n < 16:
        raise ValueError(f"config {cfg} splits its tile too finely")
    if cfg.pingpong and cfg not in PINGPONG_CANDIDATES:
        raise ValueError(f"config {cfg} is not a ping-pong configuration")
    return cfg


# Configurations the interpreter uses: small tiles so that CPU tests at sizes in
# the low hundreds still cover many tiles, several per persistent program, and
# every epilogue split.
INTERPRETER_CONFIG = Config(
    block_m=32, block_n=32, block_k=32, group_m=2, epi_split=2, num_stages=1, num_warps=4, tail_split=3
)
INTERPRETER_NUM_SMS = 3


SMEM_LIMIT = 232448  # bytes of shared memory one H100/H200 block may use
SMEM_PER_SM = 233472  # bytes per SM; each resident block also reserves 1 KB
REGS_PER_SM = 65536


def fits(cfg: Config, shared: int, regs: int) -> bool:
    """Whether ``cfg.occupancy`` blocks of this kernel fit on one SM together."""
    occ = cfg.occupancy
    # ping-pong: two consumer warpgroups and the loader's warpgroup, at the launch's register cap
    warps = 12 if cfg.pingpong else cfg.num_warps
    return (
        shared <= SMEM_LIMIT
        and occ * (shared + 1024) <= SMEM_PER_SM
        and occ * regs * 32 * warps <= REGS_PER_SM
    )


# Every GPU candidate splits a partial last wave along K into up to this many parts.
TAIL_SPLIT = 4


def _grid(tiles, splits, flattens=(False, True), block_k=64, occupancy=1):
    return [
        Config(bm, bn, block_k, 8, split, stages, warps, flatten, False, occupancy, TAIL_SPLIT)
        for bm, bn, stages, warps in tiles
        for split in splits
        for flatten in flattens
    ]


# Plain stores: the tile shapes the persistent TMA GEMM is known to like on Hopper,
# plus two programs per SM on 128x128 tiles.
PLAIN_CANDIDATES = (
    _grid(((128, 256, 3, 8), (256, 128, 3, 8)), (1, 2))
    + _grid(((128, 256, 4, 8), (256, 128, 4, 8)), (2,))
    + _grid(((128, 128, 4, 4),), (1, 2))
    + _grid(((128, 128, 3, 4),), (2,), (False,), occupancy=2)
)

# Programs that stream extra tiles through shared memory in the epilogue: their
# TMA buffers are per sub-tile, so they split the epilogue finer.
STREAMING_CANDIDATES = (
    _grid(((128, 256, 3, 8), (128, 256, 4, 8)), (4,))
    + _grid(((256, 128, 3, 8),), (2,))
    + _grid(((128, 128, 4, 8),), (2,))
)

# Programs whose accumulator is seeded from a tile (acc_init): flattening the
# loops defeats the pipelining there (measured 2x slower), so none is flattened.
SEEDED_CANDIDATES = (
    _grid(((128, 256, 3, 8), (256, 128, 3, 8)), (2, 4), (False,))
    + _grid(((128, 256, 4, 8),), (4,), (False,))
    + _grid(((256, 128, 4, 8),), (2,), (False,))
    + _grid(((128, 128, 3, 4),), (2,), (False,), occupancy=2)
)


# The RMSNorm backward program (two tile loads, two tile stores, three vectors):
# only these fit its registers without spilling.
BACKWARD_CANDIDATES = _grid(((128, 256, 3, 8), (128, 256, 4, 8)), (4,), (True,)) + _grid(
    ((128, 128, 4, 8),), (2,)
)


# The sm_90 ping-pong mainloop (programs with an ``sm90`` function, 16-bit tiles):
# 128x128 tiles per consumer, a ring of 5 or 4 stages (5 fills the shared memory
# next to the two consumers' epilogue tiles).
PINGPONG_CANDIDATES = tuple(Config(128, 128, 64, 8, 1, stages, 4, pingpong=True) for stages in (5, 4))


def gpu_candidates(n_tile_operands: int) -> list[Config]:
    """The small Hopper search space for a program with that many tile operands."""
    return list(PLAIN_CANDIDATES if n_tile_operands <= 1 else STREAMING_CANDIDATES)


# A tail part gets at least this many K blocks on the GPU (fewer would not fill
# the TMA pipeline); the interpreter splits down to one block so small tests
# reach the tail path.
MIN_K_BLOCKS_PER_PART = 4


def tail_splits(cfg: Config, tiles: int, programs: int, k_blocks: int, min_k_blocks: int) -> int:
    """How many K parts each tile of the last, partial wave is split into (1 = none).

    The ``tiles % programs`` tail tiles would run on that many programs while the
    rest idle; split into s parts they occupy ``tail * s <= programs`` programs."""
    if os.environ.get("CODETTA_TAIL_SPLIT") == "0":
        return 1
    tail = tiles % programs
    if cfg.tail_split < 2 or tail == 0:
        return 1
    s = min(cfg.tail_split, programs // tail, k_blocks // min_k_blocks)
    return s if s >= 2 else 1


def shape_bucket(x: int) -> int:
    """Round up to a power of two, so nearby shapes share a tuned config."""
    return 1 << max(0, (x - 1).bit_length())


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


def default_cache_path() -> Path:
    root = os.environ.get("CODETTA_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "codetta"
    )
    return Path(root) / "tuning.json"


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
    if os.environ.get("CODETTA_TUNE_VERBOSE") == "1":
        for cfg, ms in med.items():
            print(f"codetta:   {cfg.short():<28} {ms:.4f} ms", file=sys.stderr, flush=True)
    best = min(med, key=med.get)
    print(f"codetta: tuned {key}: {best.short()} ({med[best]:.3f} ms)", file=sys.stderr, flush=True)
    return med
