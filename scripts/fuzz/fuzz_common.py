"""What the random checks share: the 2x-PyTorch comparison, the seed loop, and where the
cases run.

By default a case runs on the CPU in float16 at the interpreter's small sizes. On a GPU
(``FUZZ_DEVICE=cuda``, ``FUZZ_DTYPE=bfloat16`` or ``float16``) the same case families run
the compiled kernels, and ``grow(seed)`` scales a case's rows and widths up (up to 64x)
so that tiles, K loops and TMA edges are crossed; it draws from its own generator, so a
seed's CPU case is the same with or without it.
"""

import contextlib
import os
import random
import sys
import traceback

import torch

from codetta.kernels import settings

DEVICE = os.environ.get("FUZZ_DEVICE", "cpu")
DTYPE = getattr(torch, os.environ.get("FUZZ_DTYPE", "float16"))
ON_GPU = DEVICE != "cpu"


def grow(seed: int) -> tuple:
    """(rows factor, widths factor) of a case: (1, 1) on the CPU; on a GPU one of a few
    sizes from tiny to a few thousand rows and columns."""
    if not ON_GPU:
        return 1, 1
    r = random.Random(seed + 1_000_003)
    return r.choice([1, 4, 16, 64]), r.choice([1, 2, 8, 32])


@contextlib.contextmanager
def drawn_settings(seed: int, desc: dict, **options):
    """codetta's settings for a case, each drawn from its list by a generator of its own
    (a seed's shapes and data are the same with or without it) and recorded in ``desc``;
    e.g. ``poison_outputs=[False, True]``: every output filled with NaN before its launch
    in half the cases, so an element no kernel writes cannot pass."""
    r = random.Random(seed + 29)
    chosen = {name: r.choice(values) for name, values in options.items()}
    desc.update(chosen)
    with settings.override(**chosen):
        yield


def err(a: torch.Tensor, ref: torch.Tensor) -> float:
    return (a.double() - ref).abs().max().item()


def leaves_as(leaves, dtype) -> list:
    """Fresh leaves for a reference in ``dtype``: float64 for all, or the same-dtype chain
    (float32 leaves, as a norm weight, stay float32 there)."""
    keep = dtype != torch.float64
    return [
        t.detach().to(torch.float32 if keep and t.dtype == torch.float32 else dtype).requires_grad_()
        for t in leaves
    ]


# the repeat mode of run_seeds (a third argument R): each case's shapes and options again
# with R sets of data, its results' error ratios collected by compare()
_DATA_OFFSET = 0
_RATIOS: dict = {}


def start(seed: int) -> random.Random:
    """A case's generator of shapes and options; seeds torch for its data (another data
    set for the same case in repeat mode)."""
    torch.manual_seed(seed + _DATA_OFFSET)
    return random.Random(seed)


def compare(names, ours, ref64, same, scales=None) -> list:
    """(name, why) for each result whose error against float64 exceeds twice PyTorch's own
    in the same dtype (plus one float32 ulp of the largest value), or that is missing or NaN; results with
    no reference (None), or whose same-dtype PyTorch result holds a NaN, are skipped.
    ``scales``: per result, the magnitude whose float32 ulp is added instead of the result's
    own largest value (None: its own), for results that are zero in exact arithmetic
    (``fuzz_hf.py``: their float64 value is ~1e-18 of noise, so the ulp term would vanish
    and the bound be 2x one accident of PyTorch's summation order against another)."""
    bad = []
    for i, (name, a, r, s) in enumerate(zip(names, ours, ref64, same)):
        if r is None or (s is not None and torch.isnan(s).any()):
            continue  # (no bound where PyTorch's own result holds a NaN: the float64 one is the check)
        if a is None or torch.isnan(a).any():
            bad.append((name, "missing/nan"))
            continue
        e, es = err(a, r), err(s, r)
        scale = r.abs().max().item() if scales is None or scales[i] is None else scales[i]
        bound = 2 * es + 2.0**-23 * scale  # (one float32 ulp: tests/util.py's term)
        _RATIOS.setdefault(name, []).append(e / bound)
        if e > bound:
            bad.append((name, f"{e:.3e} > 2x {es:.3e}"))
    return bad


def repeat(run_case, seed: int, times: int) -> None:
    """One case's shapes with ``times`` data sets: per result, the median and largest of
    (error / the 2x bound), and how many exceeded it. A bound exceeded now and then with a
    median well under 1 is the max-of-few-errors statistic; a median near or past 1 is
    a finding."""
    global _DATA_OFFSET
    _RATIOS.clear()
    for i in range(times):
        _DATA_OFFSET = 7919 * i
        desc, _ = run_case(seed)
    _DATA_OFFSET = 0
    print("seed", seed, desc, flush=True)
    for name, r in _RATIOS.items():
        r, past = sorted(r), sum(x > 1 for x in r)
        print(f"  {name}: median {r[len(r) // 2]:.2f} max {r[-1]:.2f} ({past} of {len(r)} past)")


def run_seeds(run_case, argv=None) -> int:
    """``run_case(seed) -> (description, bad)`` for seeds FIRST .. FIRST+COUNT-1 (argv);
    one line a seed, then the number that failed or raised. With a third argument R, each
    seed's case is repeated with R data sets instead (``repeat``)."""
    args = (argv or sys.argv)[1:]
    first, count = int(args[0]), int(args[1])
    if ON_GPU:
        torch.set_default_device(DEVICE)
    print("device", DEVICE, "dtype", DTYPE, flush=True)
    if len(args) > 2:
        for seed in range(first, first + count):
            repeat(run_case, seed, int(args[2]))
        return 0
    fails = 0
    for seed in range(first, first + count):
        try:
            desc, bad = run_case(seed)
        except Exception as e:
            where = traceback.extract_tb(e.__traceback__)[-1]
            print("seed", seed, "EXC", type(e).__name__, str(e)[:300], f"at {where.filename}:{where.lineno}",
                  flush=True)  # fmt: skip
            fails += 1
            continue
        print("seed", seed, "ok" if not bad else (desc, bad), flush=True)
        fails += bool(bad)
    print("fails", fails)
    return fails
