"""The docs page 'Write your own epilogue' is executable: run its code blocks in order."""

import os
import re
import runpy

DOC = os.path.join(os.path.dirname(__file__), "..", "docs", "write-your-own-epilogue.md")


def test_write_your_own_epilogue(tmp_path, capsys):
    text = open(DOC).read()
    blocks = re.findall(r"```python\n(.*?)```", text, flags=re.S)
    assert len(blocks) >= 4
    # a real file, so triton.jit can read the kernel's source
    script = tmp_path / "write_your_own_epilogue.py"
    script.write_text("\n".join(blocks))
    runpy.run_path(str(script), run_name="docs_example")
    assert "matches fp64" in capsys.readouterr().out
