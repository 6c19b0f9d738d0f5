"""Kernel configurations: the space, the candidates each mainloop tries, and the
rules that size a launch from one (tail split, occupancy)."""

from __future__ import annotations

import re
from dataclasses import dataclass, fields, replace


@dataclass(frozen=True)
class Config:
    """One kernel configuration. ``epi_split``: the epilogue sees the tile in that many
    column sub-tiles; ``flatten``: Triton flattens the persistent and K loops so the
    next tile's loads start during this tile's epilogue; ``warp_specialize``: Triton's
    automatic warp specialization, a no-op on sm_90 with triton 3.6 (same SASS), so
    no shipped candidate sets it; ``occupancy``: persistent programs per SM;
    ``tail_split``: split the tiles of a last, partial wave along K into up to that
    many parts (1 = off; ``mainloop.py``); ``pingpong``: run the sm_90 Gluon mainloop
    (``pingpong.py``: 128x128 tiles, or 64-row ones, a loader warp and two consumer
    warpgroups of ``num_warps`` each, a ring of ``num_stages`` A/B stages) instead of
    the portable one."""

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
    "group_m": {1, 2, 4, 8, 16, 32},
    "epi_split": {1, 2, 4},
    "num_stages": {1, 2, 3, 4, 5, 6, 7},
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
    if cfg.pingpong and cfg not in ALL_PINGPONG:
        raise ValueError(f"config {cfg} is not a ping-pong configuration")
    return cfg


# What the interpreter runs: small tiles, so that CPU tests at sizes in the low
# hundreds still cover many tiles, several per persistent program, every
# epilogue split and the tail split.
INTERPRETER_CONFIG = Config(
    block_m=32, block_n=32, block_k=32, group_m=2, epi_split=2, num_stages=1, num_warps=4, tail_split=3
)
INTERPRETER_NUM_SMS = 3


def interpreter_config(sub_tile_width: int = 0) -> Config:
    """The interpreter's configuration; for a program whose sub-tiles must be exactly
    ``sub_tile_width`` columns wide, one whose are."""
    cfg = INTERPRETER_CONFIG
    if not sub_tile_width or cfg.sub_n == sub_tile_width:
        return cfg
    block_n = max(cfg.block_n, sub_tile_width)
    return Config(cfg.block_m, block_n, cfg.block_k, cfg.group_m, block_n // sub_tile_width,
                  cfg.num_stages, cfg.num_warps, tail_split=cfg.tail_split)  # fmt: skip


SMEM_LIMIT = 232448  # bytes of shared memory one H100/H200 block may use
SMEM_PER_SM = 233472  # bytes per SM; each resident block also reserves 1 KB
REGS_PER_SM = 65536


def part_edges(sizes) -> list[int]:
    """Where one M or N part ends and the next begins (``sizes``: the parts' extents)."""
    return [sum(sizes[: i + 1]) for i in range(len(sizes) - 1)]


def tiles_fit_parts(cfg: Config, widths=(), heights=()) -> bool:
    """Whether every boundary between N parts (``widths``) and M parts (``heights``) falls
    on an edge of this configuration's tiles (a tile must lie within one part)."""
    return not any(e % cfg.block_n for e in part_edges(widths)) and not any(
        e % cfg.block_m for e in part_edges(heights)
    )


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


# Every GPU candidate of the portable mainloop splits a partial last wave along K
# into up to this many parts.
TAIL_SPLIT = 4


def config_grid(tiles, splits, flattens=(False, True), block_k=64, occupancy=1):
    """Portable candidates: every (block_m, block_n, stages, warps) of ``tiles`` with every
    epilogue split and flatten flag (the programs' own candidate lists use it too)."""
    return [
        Config(bm, bn, block_k, 8, split, stages, warps, flatten, False, occupancy, TAIL_SPLIT)
        for bm, bn, stages, warps in tiles
        for split in splits
        for flatten in flattens
    ]


# Plain stores: the tile shapes the persistent TMA GEMM is known to like on Hopper,
# plus two programs per SM on 128x128 tiles. Pruned to the configurations that won
# a tuning run on the H200 (NOTES.md: the tuning caches of runs 18-23).
PLAIN_CANDIDATES = (
    config_grid(((128, 256, 3, 8),), (1,))
    + config_grid(((128, 256, 3, 8), (128, 256, 4, 8)), (2,))
    + config_grid(((256, 128, 4, 8),), (2,), (False,))
    + config_grid(((128, 128, 4, 4),), (1,), (True,))
    + config_grid(((128, 128, 3, 4),), (2,), (False,), occupancy=2)
)

# Programs that stream extra tiles through shared memory in the epilogue: their
# TMA buffers are per sub-tile, so they split the epilogue finer.
STREAMING_CANDIDATES = (
    config_grid(((128, 256, 3, 8), (128, 256, 4, 8)), (4,))
    + config_grid(((256, 128, 3, 8),), (2,))
    + config_grid(((128, 128, 4, 8),), (2,))
)

# Programs whose accumulator is seeded from a tile: flattening the loops defeats
# the pipelining there (measured 2x slower), so none is flattened.
SEEDED_CANDIDATES = (
    config_grid(((128, 256, 3, 8), (256, 128, 3, 8)), (2, 4), (False,))
    + config_grid(((128, 256, 4, 8),), (4,), (False,))
    + config_grid(((256, 128, 4, 8),), (2,), (False,))
    + config_grid(((128, 128, 3, 4),), (2,), (False,), occupancy=2)
)

# Programs with two tile inputs and two tile outputs (the RMSNorm backward): 128x256
# tiles spill there (the whole fp32 tile stays live while a sub-tile's loads, vectors
# and outputs are held), so 128x128 tiles with 8 warps.
BACKWARD_CANDIDATES = config_grid(((128, 128, 4, 8), (128, 128, 3, 8)), (2, 4), (False,)) + config_grid(
    ((128, 128, 4, 8),), (4,), (True,)
)


def _pingpong(stages, splits, block_n=128):
    return tuple(Config(128, block_n, 64, 8, split, s, 4, pingpong=True) for s in stages for split in splits)


# The sm_90 ping-pong mainloop: 128x128 tiles per consumer, a ring of 5 A/B stages
# (it fills the shared memory next to the two consumers' epilogue rings; 4 stages
# lost to 5 everywhere, NOTES.md run 20).
# The more tiles a program's epilogue holds in registers at once, the finer it
# splits the tile (whole tiles spill there; the sm_90a compile check holds every
# candidate to no spills; CI its shipped picks and heaviest other).
PINGPONG_CANDIDATES = _pingpong((5,), (1, 2))


def with_row_groups(cfgs, groups=(8, 4)) -> tuple:
    """Each ping-pong candidate at each raster row-group height (``group_m``; the first
    is the candidates' own). The ping-pong kernel takes GROUP_M at run time: one binary
    for 4 and 8 (Triton specializes an integer argument only at 1 and multiples of 16: a
    group of 16 or 32 would compile again, and the sm_90a check compiles only 8's).
    The vocabulary-wide logits (4096-row chunks of V 128256, e1) took 8-15 % less time at 4
    than at 8 under paired timing and 2-7 % under sustained-block timing on an H100 (run
    225, three runs, scripts/group_ab.py; K1's shapes did not gain, the portable mainloop's
    Triton pick lost at 4). On an H200 4 gained nothing (run 232: the four logits keys
    0.997-1.026x of 8's time paired, 1.011-1.034x sustained): its table keeps 8 there."""
    return tuple(replace(c, group_m=g) for g in groups for c in cfgs)


PINGPONG_STREAMING_CANDIDATES = _pingpong((5,), (2, 4))
PINGPONG_HEAVY_CANDIDATES = _pingpong((5,), (4,))
# Epilogues that hold more tiles than the heavy candidates' 32-column sub-tiles allow
# (DSWIGLU_Y: g and u in, dg, du and y out; 32 B of stack at 128x128 split 4 under the
# default register split): 128x64 tiles split in two, the same sub-tile, half the
# accumulator
PINGPONG_NARROW_HEAVY_CANDIDATES = _pingpong((5, 4), (2,), block_n=64)
# A paired weight (SwiGLU's gate and up): each product 64 columns wide, both formed by
# one 128-wide wgmma over the stacked B stage (the same accumulator as a 128x128 tile)
PINGPONG_PAIRED_CANDIDATES = _pingpong((5,), (1, 2), block_n=64)
# A float32 ring (a seed and output in float32: a weight gradient summed over chunks
# in place): rings of whole 128x128 tiles take 128 KB, leaving room for 3 A/B stages
# (split 2); 128x64 tiles leave room for 5; rings of two sub-tiles (the seed streams
# through them: PingPongEngine.ring_slots) for 4 or 5 beside 128x128 tiles split 4.
# (The rule takes the last one.)
PINGPONG_F32_RING_CANDIDATES = (
    _pingpong((5,), (1, 2), block_n=64) + _pingpong((3,), (4, 2)) + _pingpong((4, 5), (4,))
)
# 64-row consumer tiles (m64n128 / m64n256 wgmmas), for epilogues that spill at 128 rows:
# Qwen3's per-head q/k norm + RoPE (648 B spilled on 232-register consumers at 128x128;
# none at 64x128, half the accumulator, at 1.5x a 128x128 tile's operand bytes per FLOP;
# none at 64x256 split in two heads, the accumulator of a 128x128 tile at 1.25x its bytes
# per FLOP, 3-4 A/B stages beside the rings)
PINGPONG_64_ROW_CANDIDATES = tuple(Config(64, 128, 64, 8, 1, s, 4, pingpong=True) for s in (5, 6, 7)) + tuple(
    Config(64, 256, 64, 8, 2, s, 4, pingpong=True) for s in (3, 4)
)
_ALL_PINGPONG_UNSPLIT = with_row_groups(
    _pingpong((5, 4), (1, 2, 4))
    + _pingpong((5, 4), (1, 2), block_n=64)
    + PINGPONG_F32_RING_CANDIDATES
    + PINGPONG_64_ROW_CANDIDATES
)
# Tail split on the ping-pong mainloop (``PingPongEngine``: the last partial wave's tiles
# run split along K on the portable mainloop, after the ping-pong kernel ran the rest):
# candidates only with ``CODETTA_TAIL_LAUNCH=1`` (GPU-tested, run 101), for programs
# that allow a tail split
PINGPONG_TAIL_SPLIT = 8  # (a tail of 4 tiles at 8B widths: 32 parts on 132 SMs)
ALL_PINGPONG = frozenset(
    _ALL_PINGPONG_UNSPLIT + tuple(replace(c, tail_split=PINGPONG_TAIL_SPLIT) for c in _ALL_PINGPONG_UNSPLIT)
)


def pingpong_tail_config(cfg: Config) -> Config:
    """The portable mainloop's config for a ping-pong config's split tail: the same tile,
    grouping and epilogue split (so its tile order and partial outputs are the ping-pong
    kernel's), 3 A/B stages, one warpgroup per 128x128 tile."""
    warps = 4 if cfg.block_m * cfg.block_n <= 128 * 128 else 8
    return Config(cfg.block_m, cfg.block_n, cfg.block_k, cfg.group_m, cfg.epi_split, 3, warps,
                  tail_split=cfg.tail_split)  # fmt: skip


# A tail part gets at least this many K blocks on the GPU (fewer would not fill
# the TMA pipeline); the interpreter splits down to one block so small tests
# reach the tail path.
MIN_K_BLOCKS_PER_PART = 4


def tail_splits(cfg: Config, tiles: int, programs: int, k_blocks: int, min_k_blocks: int,
                enabled: bool = True) -> int:  # fmt: skip
    """How many K parts each tile of the last, partial wave is split into (1 = none).

    The ``tiles % programs`` tail tiles would run on that many programs while the
    rest idle; split into s parts they occupy ``tail * s <= programs`` programs."""
    tail = tiles % programs
    if not enabled or cfg.tail_split < 2 or tail == 0:
        return 1
    s = min(cfg.tail_split, programs // tail, k_blocks // min_k_blocks)
    return s if s >= 2 else 1


def launch_tail_splits(cfg: Config, tail: int, grid: int, k_blocks: int, min_k_blocks: int) -> int:
    """How many K parts each of a ping-pong launch's ``tail`` last tiles is split into (1 =
    none). The parts run as their own launch after the ping-pong kernel (``engines.
    pingpong_tail``), so they need not fit one wave: ``tail * s`` parts take
    ceil(tail * s / grid) waves of 1/s of a tile each; the least such time wins (the
    fewest parts among equals). 68 tail tiles on 132 SMs: 7 parts, 0.57 of a tile's time
    instead of 1."""
    best, best_time = 1, 1.0
    if tail <= 0:
        return 1
    for s in range(2, min(cfg.tail_split, k_blocks // min_k_blocks) + 1):
        t = -(-tail * s // grid) / s
        if t < best_time - 1e-9:
            best, best_time = s, t
    return best


def shape_bucket(x: int) -> int:
    """Round up to a power of two, so nearby shapes share a tuned config."""
    return 1 << max(0, (x - 1).bit_length())


def gpu_slug(name: str) -> str:
    """A file name for a GPU name: "NVIDIA H200" -> "nvidia-h200"."""
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")
