"""Cold start: a new user's first training forward+backward against the second, in a fresh
process. Run with empty codetta and Triton caches (scripts/gpu_call.sh coldstart) to see
what a first step costs.

    python3 scripts/coldstart.py [model|ops] [--precompile]

model (default): a Hugging Face Llama with Llama-3-8B's widths, 2 decoder layers and the
LM head + loss (V 128256), patched by ``codetta.apply_codetta``: every operator the
drop-in has (the first layer's norm, q/k/v + RoPE, o-proj + residual + norm, SwiGLU,
down-proj + residual + next norm, the LM head + cross-entropy), 16384 tokens (4 x 4096),
``loss.backward()``. ops: the two residual + RMSNorm + next GEMM boundaries of one 8B
layer alone (the measurement of run 32). ``--precompile``: ``codetta.precompile`` runs
first (its time is counted in the first step's).
"""

import os
import sys
import time
from pathlib import Path

import torch

from codetta.kernels import settings
from codetta.kernels.tuning import CHOOSER
from codetta.models import KNOWN

MODE = next((a for a in sys.argv[1:] if not a.startswith("--")), "model")
PRECOMPILE = "--precompile" in sys.argv
w = KNOWN["llama3-8b"]
T, d, dt = 16384, w.hidden, torch.bfloat16


def rand(*shape, scale=1.0):
    return (torch.randn(*shape, device="cuda") * scale).to(dt).requires_grad_()


def ops_step():
    from codetta.ops import residual_rmsnorm_linear

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

    return step


def model_step():
    from transformers import LlamaConfig, LlamaForCausalLM

    import codetta

    config = LlamaConfig(hidden_size=w.hidden, intermediate_size=w.intermediate, num_attention_heads=w.heads,
                         num_key_value_heads=w.kv_heads, head_dim=w.head_dim, num_hidden_layers=2,
                         vocab_size=w.vocab, max_position_embeddings=4096, rope_theta=500000.0,
                         attn_implementation="sdpa")  # fmt: skip
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).to(device="cuda", dtype=dt)
    codetta.apply_codetta(model)
    ids = torch.randint(0, config.vocab_size, (4, T // 4), device="cuda")

    def step():
        model.zero_grad(set_to_none=True)
        model(input_ids=ids, labels=ids, use_cache=False).loss.backward()

    if PRECOMPILE:
        t0 = time.perf_counter()
        n = codetta.precompile(step)
        from codetta.kernels.compile_pool import LAST_RUN

        print(f"precompile: {n} kernels in {time.perf_counter() - t0:.2f} s ({LAST_RUN})")
    return step


t_setup = time.perf_counter()
step = model_step() if MODE == "model" else ops_step()
print(f"settings: autotune={settings.SETTINGS.autotune} shipped={settings.SETTINGS.shipped}; "
      f"mode {MODE}; setup (and precompile) {time.perf_counter() - t_setup:.2f} s")  # fmt: skip


def compiled_during(fn) -> list[str]:
    """Names of the kernels Triton compiles (in-memory cache misses) while ``fn`` runs
    (diagnostic: wraps JITFunction._do_compile for the duration)."""
    from triton.runtime.jit import JITFunction

    names, original = [], JITFunction._do_compile

    def recording(self, *args, **kwargs):
        names.append(self.fn.__qualname__)
        return original(self, *args, **kwargs)

    JITFunction._do_compile = recording
    try:
        fn()
    finally:
        JITFunction._do_compile = original
    return names


times = []
for i in range(3):
    t0 = time.perf_counter()
    names = compiled_during(step)
    torch.cuda.synchronize()
    times.append(time.perf_counter() - t0)
    print(f"step {i + 1}: {times[-1]:.2f} s, {len(names)} kernels compiled: "
          f"{', '.join(sorted(set(names)))}")  # fmt: skip
print(f"first step's extra time over a warm step: {times[0] - times[-1]:.1f} s")
shipped = CHOOSER.shipped(0)
print(f"shipped table entries for this GPU: {len(shipped)}; user cache entries (tuned here): "
      f"{len(CHOOSER.cache(0).entries)}")  # fmt: skip
cache = Path(os.environ.get("TRITON_CACHE_DIR", Path.home() / ".triton/cache"))
print(f"kernels compiled (cubins in {cache}): {len(list(cache.rglob('*.cubin')))}")
