"""torch.compile(mode="reduce-overhead") over the residual + norm + next GEMM operator, and
if CUDA graph trees reject a live tensor in their pool, which tensor it is and what holds
it (GPU machine). Run 168 found the tail split's arrival counters this way (NOTES.md,
"The host's time per launch; torch.compile reduce-overhead over the operators").

Usage (repo root): python scripts/graph_pool_check.py
"""

import gc
import re

import torch

from codetta.ops import residual_rmsnorm_linear


def rand(*shape, scale=1.0):
    return (torch.randn(*shape, device="cuda") * scale).to(torch.bfloat16)


def main() -> None:
    M, K, d, N = 1024, 1024, 2048, 4096
    leaves = [rand(M, K), rand(d, K, scale=K**-0.5), rand(M, d), torch.rand(d, device="cuda") + 0.5,
              rand(N, d, scale=d**-0.5)]  # fmt: skip

    def step(fn):
        ts = [t.detach().clone().requires_grad_() for t in leaves]
        x, z = fn(*ts)
        (x.float().sum() + z.float().pow(2).sum()).backward()
        return [x.detach().clone(), z.detach().clone()] + [t.grad.clone() for t in ts]

    want = step(residual_rmsnorm_linear)
    compiled = torch.compile(residual_rmsnorm_linear, mode="reduce-overhead")
    try:
        for _ in range(3):  # warm-up, record, replay
            got = step(compiled)
    except RuntimeError as e:
        ptrs = {int(p) for p in re.findall(r"Data Pointer: (\d+)", str(e))}
        print(f"FAILED: {str(e).splitlines()[0]}; pointers {sorted(ptrs)}")
        for o in gc.get_objects():
            if type(o) is torch.Tensor and o.is_cuda and o.untyped_storage().data_ptr() in ptrs:
                print(f"  live tensor {tuple(o.shape)} {o.dtype}, held by:")
                for r in gc.get_referrers(o):
                    what = sorted(map(str, r))[:6] if isinstance(r, dict) else repr(r)[:160]
                    print(f"    {type(r).__name__}: {what}")
        return
    print("passed: replays equal to eager:", all(torch.equal(a, b) for a, b in zip(got, want)))


if __name__ == "__main__":
    main()
