"""The docs page 'Write your own epilogue' is executable: run its code blocks in order,
each time in a fresh process (the page itself decides whether the interpreter runs)."""

import os
import re
import subprocess
import sys

import pytest
from conftest import ON_GPU

DOC = os.path.join(os.path.dirname(__file__), "..", "docs", "write-your-own-epilogue.md")


def _run_page(tmp_path, interpret=None, edit=None):
    text = open(DOC).read()
    blocks = re.findall(r"```python\n(.*?)```", text, flags=re.S)
    assert len(blocks) >= 5
    source = "\n".join(blocks)
    if edit is not None:
        assert edit[0] in source
        source = source.replace(*edit)
    # a real file, so triton.jit can read the kernels' source
    script = tmp_path / "write_your_own_epilogue.py"
    script.write_text(source)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    if interpret is not None:
        env["TRITON_INTERPRET"] = interpret
    return subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=900)


def test_page_runs_the_kernel(tmp_path):
    """As a reader runs it: on a CPU the page switches the interpreter on itself, so its
    check exercises the kernel, not the reference."""
    proc = _run_page(tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "matches fp64" in proc.stdout
    assert ("the GPU" if ON_GPU else "the Triton interpreter (the kernel itself)") in proc.stdout


@pytest.mark.skipif(ON_GPU, reason="CPU behaviour: the interpreter checks the body")
def test_page_catches_a_wrong_body(tmp_path):
    """The page's own check fails when the kernel's body is wrong (relu instead of relu^2)."""
    proc = _run_page(tmp_path, edit=("out = relu * relu", "out = relu"))
    assert proc.returncode != 0 and "AssertionError" in proc.stderr


def test_page_compiles_for_sm90(tmp_path):
    """With the interpreter off: the reference path (said loudly) and the sm_90a compile of
    the page's program on both mainloops."""
    if ON_GPU:
        pytest.skip("the GPU runs the kernel itself")
    proc = _run_page(tmp_path, interpret="0")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "the kernel did not run" in proc.stdout
    assert "compiles for sm_90a on both mainloops" in proc.stdout
