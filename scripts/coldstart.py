"""Cold start: the first forward+backward of an 8B-width decoder layer's codetta operators
(16384 tokens, bf16) against the second, in a fresh process. Run with empty codetta and
Triton caches (scripts/gpu_call.sh coldstart) to see what a new user's first step costs."""

import time

import torch

from codetta.kernels import settings
from codetta.kernels.tuning import CHOOSER
from codetta.models import KNOWN
from codetta.ops import residual_rmsnorm_linear

w = KNOWN["llama3-8b"]
T, d, dt = 16384, w.hidden, torch.bfloat16


def rand(*shape, scale=1.0):
    return (torch.randn(*shape, device="cuda") * scale).to(dt).requires_grad_()


boundaries = [(w.q_width, 2 * w.intermediate), (w.intermediate, w.qkv_width)]
args = [
    (rand(T, k), rand(d, k, scale=k**-0.5), rand(T, d), torch.ones(d, device="cuda", requires_grad=True),
     rand(n, d, scale=d**-0.5))
    for k, n in boundaries
]  # fmt: skip


def step():
    for a in args:
        x, z = residual_rmsnorm_linear(*a)
        torch.autograd.backward([x, z], [torch.ones_like(x), torch.ones_like(z)])
    torch.cuda.synchronize()


print(f"settings: autotune={settings.SETTINGS.autotune} shipped={settings.SETTINGS.shipped}")
times = []
for i in range(3):
    t0 = time.perf_counter()
    step()
    times.append(time.perf_counter() - t0)
    print(f"step {i + 1}: {times[-1]:.2f} s")
print(f"first step's extra time over a warm step: {times[0] - times[-1]:.1f} s")
shipped = CHOOSER.shipped(0)
print(
    f"shipped table entries for this GPU: {len(shipped)}; user cache entries: {len(CHOOSER.cache(0).entries)}"
)
import os  # noqa: E402
from pathlib import Path  # noqa: E402

cache = Path(os.environ.get("TRITON_CACHE_DIR", Path.home() / ".triton/cache"))
print(f"kernels compiled (cubins in {cache}): {len(list(cache.rglob('*.cubin')))}")
