"""What a new user meets first: the import, the command line, the README's promises."""

import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

NO_NUMPY = """
import sys

class Block:
    def find_spec(self, name, path=None, target=None):
        if name == "numpy" or name.startswith("numpy."):
            raise ModuleNotFoundError("No module named 'numpy'", name="numpy")

sys.meta_path.insert(0, Block())
import torch
import codetta
a, w = torch.randn(16, 64).half(), torch.randn(32, 64).half()
assert codetta.gemm(a, w).shape == (16, 32)
print("ok without numpy")
"""


def _env():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    return env


def test_imports_without_numpy():
    """numpy is a test dependency (the interpreter's), not a runtime one."""
    proc = subprocess.run([sys.executable, "-c", NO_NUMPY], env=_env(), capture_output=True, text=True)
    assert proc.returncode == 0 and "ok without numpy" in proc.stdout, proc.stderr[-2000:]


def test_help_is_plain_text():
    proc = subprocess.run(
        [sys.executable, "-m", "codetta", "--help"], env=_env(), capture_output=True, text=True
    )
    assert proc.returncode == 0
    assert "``" not in proc.stdout and "python -m codetta demo" in proc.stdout


def _doc_pages() -> list:
    """README.md and every page of docs/ (the README's long sections live there)."""
    docs = os.path.join(ROOT, "docs")
    return [os.path.join(ROOT, "README.md")] + [
        os.path.join(docs, f) for f in sorted(os.listdir(docs)) if f.endswith(".md")
    ]


def test_readme_options_exist():
    """Every ``python -m codetta ...`` option the README and docs/ show is one the CLI takes."""
    text = "\n".join(open(p).read() for p in _doc_pages())
    uses = re.findall(r"python -m codetta(?: (demo|bench))?((?: --[a-z-]+)*)", text)
    assert uses
    for cmd, opts in uses:
        for opt in opts.split():
            if not cmd:
                raise AssertionError(
                    f"the README or docs/ give 'python -m codetta {opt}': options belong to a subcommand"
                )
            proc = subprocess.run(
                [sys.executable, "-m", "codetta", cmd, "--help"], env=_env(), capture_output=True, text=True
            )
            assert opt in proc.stdout, f"'python -m codetta {cmd}' has no {opt}"


def test_doc_links_resolve():
    """Every relative link of the README and docs/ names a file or folder that exists (the
    README's long sections moved to docs/ on 2026-12-07, their links rewritten)."""
    checked = 0
    for page in _doc_pages():
        for target in re.findall(r"\]\(([^)\s]+)\)", open(page).read()):
            if re.match(r"[a-z]+:", target) or target.startswith("#") or target == "...":
                continue
            path = os.path.normpath(os.path.join(os.path.dirname(page), target.split("#")[0]))
            where = os.path.relpath(page, ROOT)
            assert os.path.exists(path), f"{where} links to {target}, which does not exist"
            checked += 1
    assert checked > 30


def test_every_setting_is_documented():
    """Every CODETTA_* variable the settings read is in the settings module's table and in
    docs/design.md's list (CODETTA_CE_NORM_FACTORS was missing from the latter for sessions)."""
    src = open(os.path.join(ROOT, "codetta", "kernels", "settings.py")).read()
    read = set(re.findall(r'"(CODETTA_[A-Z0-9_]+)"', src))
    assert len(read) > 20
    table = set(re.findall(r"``(CODETTA_[A-Z0-9_]+)``", src))
    design = set(re.findall(r"`(CODETTA_[A-Z0-9_]+)`", open(os.path.join(ROOT, "docs", "design.md")).read()))
    assert read <= table, f"not in settings.py's table: {sorted(read - table)}"
    assert read <= design, f"not in docs/design.md: {sorted(read - design)}"


def test_ce_chunk_setting():
    """CODETTA_CE_CHUNK_MB: a whole number >= 1 (default 1024 MiB); it sets the rows per
    chunk of linear_cross_entropy."""
    from codetta.kernels import settings
    from codetta.ops.cross_entropy import rows_per_chunk

    assert settings.Settings.from_env({}).ce_chunk_mb == 1024
    assert settings.Settings.from_env({"CODETTA_CE_CHUNK_MB": "256"}).ce_chunk_mb == 256
    for bad in ("0", "-5", "big"):
        with pytest.raises(ValueError, match="CODETTA_CE_CHUNK_MB"):
            settings.Settings.from_env({"CODETTA_CE_CHUNK_MB": bad})
    assert rows_per_chunk(16384, 128256, 2) == 4096  # 1 GiB of bf16 logits
    with settings.override(ce_chunk_mb=256):
        assert rows_per_chunk(16384, 128256, 2) == 1024


def test_ce_vocab_chunk_setting():
    """CODETTA_CE_VOCAB_CHUNK: 0 (off) or a multiple of 8; when set, linear_cross_entropy
    (and so the drop-in's loss) runs the low-memory mode without an argument."""
    import torch

    from codetta.kernels import settings
    from codetta.kernels.launch import recording
    from codetta.ops import linear_cross_entropy

    assert settings.Settings.from_env({}).ce_vocab_chunk == 0
    assert settings.Settings.from_env({"CODETTA_CE_VOCAB_CHUNK": "4096"}).ce_vocab_chunk == 4096
    for bad in ("12", "-8", "many"):
        with pytest.raises(ValueError, match="CODETTA_CE_VOCAB_CHUNK"):
            settings.Settings.from_env({"CODETTA_CE_VOCAB_CHUNK": bad})
    x = torch.randn(16, 32, requires_grad=True)
    w = torch.randn(64, 32, requires_grad=True)
    t = torch.randint(0, 64, (16,))
    with settings.override(ce_vocab_chunk=32), recording(compute=True) as rec:
        linear_cross_entropy(x, w, t).backward()
    assert [c.N for c in rec if c.program.name == "ce_logits"] == [32, 32]  # two slices


def test_sm_margin_setting():
    """CODETTA_SM_MARGIN: a whole number (default 0); anything else is refused at import
    with the variable's name."""
    from codetta.kernels import device, settings

    env = {"CODETTA_SM_MARGIN": "16"}
    assert settings.Settings.from_env({}).sm_margin == 0
    assert settings.Settings.from_env(env).sm_margin == 16
    for bad in ("-1", "many", "1.5", "auto"):
        with pytest.raises(ValueError, match="CODETTA_SM_MARGIN"):
            settings.Settings.from_env({"CODETTA_SM_MARGIN": bad})
    assert device.sm_margin() == 0
    with settings.override(sm_margin=24):
        assert device.sm_margin() == 24


def test_tune_seconds_setting():
    """CODETTA_TUNE_SECONDS: the paired timing per shape of hot-path tuning, positive."""
    from codetta.kernels import settings

    assert settings.Settings.from_env({}).tune_seconds == 1.0
    assert settings.Settings.from_env({"CODETTA_TUNE_SECONDS": "0.3"}).tune_seconds == 0.3
    for bad in ("0", "-1", "inf", "nan", "soon"):
        with pytest.raises(ValueError, match="CODETTA_TUNE_SECONDS"):
            settings.Settings.from_env({"CODETTA_TUNE_SECONDS": bad})


def test_autocast_setting():
    """CODETTA_AUTOCAST: the cast mode under autocast by default, the model's own forward on
    request; a word it does not know is refused by name, from the environment and from
    ``override`` alike (which used to take any value of a word-valued setting)."""
    from codetta.kernels import settings

    assert settings.Settings.from_env({}).autocast == "cast"
    assert settings.Settings.from_env({"CODETTA_AUTOCAST": "own-forward"}).autocast == "own-forward"
    for bad in ("", "1", "Cast"):
        with pytest.raises(ValueError, match="CODETTA_AUTOCAST"):
            settings.Settings.from_env({"CODETTA_AUTOCAST": bad})
    for name in ("autocast", "tune_method", "pingpong_policy"):
        with pytest.raises(ValueError, match=f"{name} must be one of"), settings.override(**{name: "bogus"}):
            pass
    assert settings.SETTINGS.autocast == "cast"


def test_tune_method_setting(monkeypatch):
    """CODETTA_TUNE_METHOD picks how the tuner times candidates: paired by default, settled
    sustained blocks on request; anything else is refused by name."""
    from codetta.kernels import settings, timing, tuning

    assert settings.Settings.from_env({}).tune_method == "paired"
    assert settings.Settings.from_env({"CODETTA_TUNE_METHOD": "sustained"}).tune_method == "sustained"
    for bad in ("", "blocks", "Paired"):
        with pytest.raises(ValueError, match="CODETTA_TUNE_METHOD"):
            settings.Settings.from_env({"CODETTA_TUNE_METHOD": bad})
    seen = []
    monkeypatch.setattr(tuning.torch.cuda, "synchronize", lambda: None)
    monkeypatch.setattr(timing, "paired_ms", lambda fns, **kw: seen.append(("paired", kw)) or {})
    monkeypatch.setattr(timing, "sustained_ms", lambda fns, **kw: seen.append(("sustained", kw)) or {})
    tuning._measure({}, 0.3)
    with settings.override(tune_method="sustained"):
        tuning._measure({}, 0.3)
    assert [m for m, _ in seen] == ["paired", "sustained"]
    assert seen[0][1]["min_s"] == 0.3
    assert seen[1][1]["settle_ms"] >= 100  # a block must start from its own clock state
    # "both": a config best under one timing but 5 % behind under the other loses to one
    # 1 % behind under each
    p = {"a": 1.00, "b": 1.01, "c": 1.03}
    t = {"a": 1.05, "b": 1.01, "c": 1.00}
    monkeypatch.setattr(timing, "paired_ms", lambda fns, **kw: p)
    monkeypatch.setattr(timing, "sustained_ms", lambda fns, **kw: t)
    with settings.override(tune_method="both"):
        scores = tuning._measure({}, 0.3)
    assert min(scores, key=scores.get) == "b"
    assert scores["a"] == pytest.approx(1.05) and scores["c"] == pytest.approx(1.03)


def test_tune_cli_method_reaches_the_tuner(monkeypatch):
    """`codetta tune --method sustained` times with that method, and restores the setting."""
    from codetta import tune
    from codetta.kernels.settings import SETTINGS

    seen = []

    def fake(args, calls, out, start=None):
        assert start is not None  # (--time-limit counts from the command's start)
        seen.append(SETTINGS.tune_method)
        return 0

    monkeypatch.setattr(tune, "_tune_all", fake)
    monkeypatch.setattr(tune.torch.cuda, "is_available", lambda: True)
    from codetta.__main__ import main

    assert main(["tune", "--model", "llama3-1b", "--tokens", "4096", "--method", "sustained"]) == 0
    assert main(["tune", "--model", "llama3-1b", "--tokens", "4096"]) == 0
    assert seen == ["sustained", "paired"]
    assert SETTINGS.tune_method == "paired"


def test_triton_series_check():
    """codetta warns at import under a Triton other than the series its kernels are tested
    for (pip installs it beside a PyTorch that pins another Triton only with --no-deps or
    a forced install), naming both versions; the pinned series passes."""
    from codetta.kernels.device import triton_mismatch

    assert triton_mismatch("3.6.0") is None and triton_mismatch("3.6.1") is None
    why = triton_mismatch("3.7.0")
    assert why and "Triton 3.6.x" in why and "Triton 3.7.0" in why and "no GPU run" in why
    assert "no GPU run" in triton_mismatch("3.8.1") and "may fail" in triton_mismatch("3.9.0")
    assert triton_mismatch("3.10.0") and triton_mismatch("4.0") and triton_mismatch("nightly")


def test_switches_take_words_and_refuse_the_rest():
    """The on/off variables (CODETTA_AUTOTUNE, CODETTA_PINGPONG, ...): 1 / true / on / yes
    and 0 / false / off / no in any case, unset or empty for the default; anything else is
    refused with the variable's name (``false`` was once read as on: any value but "0")."""
    from codetta.kernels import settings

    S = settings.Settings.from_env
    for word in ("0", "false", "FALSE", "off", "No", " 0 "):
        assert S({"CODETTA_AUTOTUNE": word}).autotune is False
        assert S({"CODETTA_PINGPONG": word}).pingpong is False
        assert S({"CODETTA_SWIGLU_KEEP_Y": word}).swiglu_keep_y is False
    for word in ("1", "true", "On", "yes"):
        assert S({"CODETTA_AUTOTUNE": word}).autotune is True
        assert S({"CODETTA_SWIGLU_KEEP_Y": word}).swiglu_keep_y is True
    assert S({"CODETTA_AUTOTUNE": ""}).autotune is False and S({}).autotune is False
    assert S({"CODETTA_PINGPONG": ""}).pingpong is True and S({}).pingpong is True
    assert S({"CODETTA_SWIGLU_KEEP_Y": ""}).swiglu_keep_y is None
    for bad in ("2", "maybe", "disable"):
        with pytest.raises(ValueError, match="CODETTA_PINGPONG"):
            S({"CODETTA_PINGPONG": bad})
        with pytest.raises(ValueError, match="CODETTA_SWIGLU_KEEP_Y"):
            S({"CODETTA_SWIGLU_KEEP_Y": bad})
