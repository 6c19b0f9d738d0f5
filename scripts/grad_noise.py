"""Is a gradient's "2x PyTorch's error" failure noise or a defect? (CPU or GPU)

tests/test_hf.py::test_matches_unpatched checks every parameter gradient of a tiny patched
model against the float64 model, within twice the unpatched model's error in the same
dtype, for one seed. For a small gradient (a q/k norm weight has head_dim elements) that
bound compares two maxima over few elements, and PyTorch's own error can be small by luck.
This script runs the same comparison over many seeds (fresh weights and token ids each)
and prints, per parameter, the ratio err(codetta) / err(PyTorch) as median, maximum and
how many seeds exceed 2: a defect shows as a median near or above 2, noise as a median
below 1 with rare excursions. (NOTES.md, "A test's statistic".)

Usage (repo root): PYTHONPATH=.:tests python scripts/grad_noise.py [family] [seeds] [head_dim]
(family: llama, qwen3 or mistral; default qwen3 tied, 12 seeds, head_dim 16; on a GPU in
bf16 with the real kernels, on a CPU in bf16 through the programs' PyTorch references)
"""

from __future__ import annotations

import copy
import statistics
import sys
import warnings

import torch

import codetta

sys.path.insert(0, "tests")
import test_hf as hf  # noqa: E402  (the test's model, inputs and step)
from util import err  # noqa: E402


def ratios(family: str, seeds: int, head_dim: int) -> dict:
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    widths = {} if head_dim == 16 else dict(hidden_size=2 * head_dim, intermediate_size=3 * head_dim,
                                            head_dim=head_dim)  # fmt: skip
    out: dict = {}
    for seed in range(seeds):
        model = hf._model(family, True, torch.bfloat16, seed=1000 + seed, **widths).to(dev)
        ref64, plain = copy.deepcopy(model).double(), copy.deepcopy(model)
        ours = codetta.apply_codetta(copy.deepcopy(model))
        kw = hf._inputs("none")
        gen = torch.Generator().manual_seed(seed)
        ids = torch.randint(0, 128, tuple(kw["input_ids"].shape), generator=gen)
        labels = ids.clone()
        labels[0, :3] = -100
        kw.update(input_ids=ids.to(dev), labels=labels.to(dev))
        want, same, got = (hf._step(m, kw) for m in (ref64, plain, ours))
        for name in same[2]:
            e_torch = err(same[2][name], want[2][name])
            out.setdefault(name, []).append(err(got[2][name], want[2][name]) / max(e_torch, 1e-30))
    return out


def main() -> None:
    warnings.filterwarnings("ignore")
    family = sys.argv[1] if len(sys.argv) > 1 else "qwen3"
    seeds = int(sys.argv[2]) if len(sys.argv) > 2 else 12
    head_dim = int(sys.argv[3]) if len(sys.argv) > 3 else 16
    found = ratios(family, seeds, head_dim)
    where = "GPU kernels" if torch.cuda.is_available() else "CPU references"
    print(f"{family}, tied, head_dim {head_dim}, {seeds} seeds, bf16, {where}: err(codetta) / err(PyTorch)")
    for name, rs in found.items():
        over = sum(r > 2 for r in rs)
        print(f"  {name:48s} median {statistics.median(rs):5.2f}  max {max(rs):5.2f}  > 2: {over}/{len(rs)}")
    every = [r for rs in found.values() for r in rs]
    print(f"  all {len(every)}: median {statistics.median(every):.2f}, > 2: {sum(r > 2 for r in every)}")


if __name__ == "__main__":
    main()
