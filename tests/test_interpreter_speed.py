"""The CPU suite's interpreter speed-ups (``interpreter_speed.py``) change no result: the
same kernels give the same bits with and without them, and each patch answers as the
code it replaces."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import ON_GPU

TESTS = Path(__file__).resolve().parent

_RUN = r"""
import os, sys
os.environ["TRITON_INTERPRET"] = "1"
sys.path.insert(0, {tests!r})
if sys.argv[1] == "fast":
    import interpreter_speed
    assert interpreter_speed.install()
import torch
from codetta.ops import linear_cross_entropy, residual_rmsnorm_linear

torch.manual_seed(0)
M, K, d, N, V = 37, 48, 32, 40, 50
h = lambda *s: (torch.randn(*s) * 2).half().requires_grad_()
y, w_o, r, w = h(M, K), h(d, K), h(M, d), h(N, d)
gamma = (torch.rand(d) + 0.5).requires_grad_()
x, z = residual_rmsnorm_linear(y, w_o, r, gamma, w, 1e-5)
t = torch.randint(0, V, (M,))
t[3] = -100
head = h(V, d)
loss = linear_cross_entropy(x.float().half(), head, t, reduction="sum")
(loss + (z.float() * torch.randn(M, N)).sum()).backward()
torch.save([x, z, loss] + [p.grad for p in (y, w_o, r, gamma, w, head)], sys.argv[2])
"""


@pytest.mark.skipif(ON_GPU, reason="the interpreter's speed-ups are CPU-suite only")
def test_same_bits_with_and_without_the_speed_ups(tmp_path):
    """A residual + norm + next GEMM forward and backward and a loss over it, run through
    the interpreter in two fresh processes, one with ``interpreter_speed.install()`` and
    one without: every output and gradient bit-equal."""
    script = tmp_path / "run.py"
    script.write_text(_RUN.format(tests=str(TESTS)))
    env = {k: v for k, v in os.environ.items() if k != "CODETTA_TEST_PLAIN_INTERPRETER"}
    out = {}
    for mode in ("fast", "plain"):
        out[mode] = tmp_path / f"{mode}.pt"
        cmd = [sys.executable, str(script), mode, str(out[mode])]
        res = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
        assert res.returncode == 0, res.stderr[-3000:]
    fast, plain = (torch.load(out[m]) for m in ("fast", "plain"))
    assert len(fast) == len(plain) == 9
    for i, (a, b) in enumerate(zip(fast, plain)):
        assert a.dtype == b.dtype and torch.equal(a.view(-1), b.view(-1)), f"tensor {i} differs"
        assert torch.isfinite(a.float()).all(), f"tensor {i} not finite: nothing compared"


@pytest.mark.skipif(ON_GPU, reason="the interpreter's speed-ups are CPU-suite only")
def test_each_patch_answers_as_the_code_it_replaces():
    """With the speed-ups installed (conftest.py): the dtype table's answers are Triton's own
    for every type it holds, tuple types' names the eager formula's, a tuple's type the one
    given or formed from its values (and formed again after ``_setitem``), the overflow
    sanitizer off."""
    import triton.language as tl
    from triton.runtime import interpreter

    if os.environ.get("CODETTA_TEST_PLAIN_INTERPRETER") == "1":
        pytest.skip("the speed-ups are off (CODETTA_TEST_PLAIN_INTERPRETER=1)")
    fast = interpreter._get_np_dtype
    assert getattr(fast, "codetta_wrapped", False)
    types = [tl.int1, tl.float16, tl.bfloat16, tl.float32, tl.float64, tl.int8, tl.uint8, tl.int32, tl.uint32,
             tl.int64, tl.uint64, tl.float8e5, tl.float8e4nv]  # fmt: skip
    import numpy as np

    want = [bool, np.float16, np.uint16, np.float32, np.float64, np.int8, np.uint8, np.int32, np.uint32,
            np.int64, np.uint64, np.uint8, np.uint8]  # fmt: skip
    for t, w in zip(types, want):
        assert fast(t) == np.dtype(w) and fast(tl.block_type(t, [2, 4])) == np.dtype(w), t
    assert fast(tl.pointer_type(tl.float16)) == np.dtype(np.uint64)
    assert fast(tl.block_type(tl.pointer_type(tl.int32), [4])) == np.dtype(np.uint64)
    tt = tl.core.tuple_type([tl.float16, tl.core.constexpr_type(3)], ["a", "b"])
    assert tt.name == str(tt) == "[a:fp16,b:constexpr_type[3]]"
    if getattr(tl.core.tuple_type, "codetta_lazy_name", False):  # (Triton 3.7 on names lazily itself)
        assert tl.core.tuple_type([tl.int32]).name == "[:int32]"
    named = tl.core.tuple([tl.core.constexpr(1), tl.core.constexpr(2)], tt)
    assert named.type is tt and named.a == 1 and named.b == 2
    plain = tl.core.tuple([tl.core.constexpr(1), 2.0])
    assert plain.type == tl.core.tuple_type([tl.core.constexpr_type(1), tl.core.constexpr_type(2.0)])
    plain._setitem(1, 3)
    assert plain.type == tl.core.tuple_type([tl.core.constexpr_type(1), tl.core.constexpr_type(3)])
    assert interpreter.interpreter_builder.options.sanitize_overflow is False
