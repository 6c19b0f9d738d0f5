"""The docs page 'Write your own epilogue' is executable: run its code blocks in order."""

import os
import re
import runpy
import subprocess
import sys

DOC = os.path.join(os.path.dirname(__file__), "..", "docs", "write-your-own-epilogue.md")


def _script(tmp_path):
    text = open(DOC).read()
    blocks = re.findall(r"```python\n(.*?)```", text, flags=re.S)
    assert len(blocks) >= 5
    # a real file, so triton.jit and gluon.jit can read the kernels' source
    script = tmp_path / "write_your_own_epilogue.py"
    script.write_text("\n".join(blocks))
    return script


def test_write_your_own_epilogue(tmp_path, capsys):
    """Through the Triton interpreter (the kernels themselves), in this process."""
    runpy.run_path(str(_script(tmp_path)), run_name="docs_example")
    assert "matches fp64" in capsys.readouterr().out


def test_write_your_own_epilogue_sm90(tmp_path):
    """Without the interpreter, in a fresh process (on a CPU: the PyTorch references, and
    the page's Gluon program compiled for sm_90a)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run(
        [sys.executable, str(_script(tmp_path))], env=env, capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "matches fp64" in proc.stdout
    assert "compiles for sm_90a" in proc.stdout
