"""How much of each GEMM's time a last partial wave wastes, with the shipped table's
configs, and what ``CODETTA_TAIL_LAUNCH=1`` would win back (CPU, no GPU needed).

For each distinct GEMM of a model's training step at one token count (``codetta tune``'s
recorded calls: forward and backward of one layer, the LM head's chunks) it takes the
shipped H200 entry, counts tiles against the grid (132 SMs; two programs per SM where the
config says so) and models time in tile-times per program: whole rounds plus the last,
partial one (or, split, ceil(tail * s / grid) / s of it). The FLOP-weighted sum is a
bound on the gain from the tail alone (it ignores the partials' traffic and the tail
launch's start; NOTES.md, "Ping-pong tail split").

Usage (repo root): python scripts/tail_waste.py [MODEL] [TOKENS]   (default llama3-1b 16384)
"""

import json
import math
import sys
from dataclasses import replace
from pathlib import Path

from codetta.kernels import configs
from codetta.kernels.engines import own_launch_tail, tail_allowed
from codetta.kernels.settings import override
from codetta.models import widths_of
from codetta.tune import model_calls

SMS = 132


def rounds(cfg, tiles: int, grid: int, k_blocks: int, launch: bool) -> float:
    """Tile-times per program of one launch (plus its tail launch when ``launch``)."""
    full, tail = divmod(tiles, grid)
    if tail == 0:
        return full
    if not cfg.pingpong and cfg.tail_split > 1:
        s = configs.tail_splits(cfg, tiles, grid, k_blocks, configs.MIN_K_BLOCKS_PER_PART)
        if s > 1:
            return full + 1 / s
    if launch and (cfg.tail_split > 1 or cfg.pingpong):
        # the launch's own choice (engines.own_launch_tail: none for a single wave)
        c = replace(cfg, tail_split=configs.PINGPONG_TAIL_SPLIT) if cfg.pingpong else cfg
        own = own_launch_tail(c, tiles, grid, k_blocks, c)
        if own is not None:
            return full + math.ceil(tail * own.splits / grid) / own.splits
    return full + 1


def main() -> None:
    model = sys.argv[1] if len(sys.argv) > 1 else "llama3-1b"
    tokens = int(sys.argv[2]) if len(sys.argv) > 2 else 16384
    table = json.loads((Path(configs.__file__).parent / "tuned" / "nvidia-h200.json").read_text())["entries"]
    rows, total, now, then = [], 0.0, 0.0, 0.0
    for key, call in sorted(model_calls(widths_of(model), (tokens,)).items()):
        if key not in table:
            continue
        cfg = configs.config_from_dict(table[key])
        grid = SMS * (1 if cfg.pingpong else cfg.occupancy)
        tiles = -(-call.M // cfg.block_m) * -(-call.N // cfg.block_n)
        k_blocks = -(-call.k_total // cfg.block_k)
        ideal = tiles / grid
        a = rounds(cfg, tiles, grid, k_blocks, False)
        with override(tail_launch=True):
            b = rounds(cfg, tiles, grid, k_blocks, tail_allowed(call.program))
        flops = 2 * call.M * call.N * call.k_total
        total, now, then = total + flops, now + flops * a / ideal, then + flops * b / ideal
        rows.append(
            (key.split("@")[0], call.M, call.N, call.k_total, cfg.short(), tiles, ideal / a, ideal / b)
        )
    print(f"{model}, {tokens} tokens, shipped H200 configs, {SMS} SMs: wave efficiency (ideal / modelled)")
    print(f"{'program':<18}{'M':>7}{'N':>7}{'K':>7}  {'config':<28}{'tiles':>7}{'now':>7}{'launch':>8}")
    for name, M, N, K, short, tiles, e_now, e_then in rows:
        print(f"{name:<18}{M:>7}{N:>7}{K:>7}  {short:<28}{tiles:>7}{e_now:>7.3f}{e_then:>8.3f}")
    print(f"FLOP-weighted: now {total / now:.3f}, with CODETTA_TAIL_LAUNCH=1 {total / then:.3f} "
          f"({(now - then) / now * 100:.1f} % of the GEMMs' time, at most)")  # fmt: skip


if __name__ == "__main__":
    main()
