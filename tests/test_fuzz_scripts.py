"""The random-shape checks of ``scripts/fuzz/`` still run against the current API, and
a few of their seeds (one token, odd vocabularies, every option family among them)
pass: the three bugs they found (NOTES.md) each had such a case."""

import importlib
import sys
from pathlib import Path

import pytest
from conftest import ON_GPU

FUZZ = Path(__file__).resolve().parents[1] / "scripts" / "fuzz"

pytestmark = pytest.mark.skipif(ON_GPU, reason="CPU checks (interpreter, fp16 and fp32)")


@pytest.fixture(scope="module")
def fuzz_path():
    sys.path.insert(0, str(FUZZ))
    yield
    sys.path.remove(str(FUZZ))


# seeds that reach the fixed bugs' shapes: op 4 (one token, a backward with K = 1), ce 14
# (one row of an odd vocabulary), mlp 0-2; each script's own loop prints every case
@pytest.mark.parametrize("script,seeds", [("fuzz_op", (1, 4)), ("fuzz_ce", (14, 19)), ("fuzz_mlp", (0, 1))])
def test_fuzz_seeds_pass(script, seeds, fuzz_path):
    mod = importlib.import_module(script)
    for seed in seeds:
        desc, bad = mod.run_case(seed)
        assert not bad, (seed, desc, bad)


def test_fuzz_drop_in_seed(fuzz_path, capsys):
    """One model of each kind of the drop-in check: an odd vocabulary (257) with one loss
    token, patched against unpatched."""
    mod = importlib.import_module("fuzz_hf")
    mod.main(2, 1)
    out = capsys.readouterr().out
    assert "seed 2" in out and "CHECK" not in out and "EXC" not in out, out


def test_fuzz_drop_in_zero_gradients_judged_against_float64(fuzz_path, capsys, monkeypatch):
    """Seed 3514 (right padding leaves each row's one loss token a query that sees one key:
    its q and k gradients are zero in exact arithmetic, ~1e-9 of rounding noise on both
    sides, 1.5 apart relatively): judged against float64 it passes; the same case with
    the patched model's q_proj gradient moved by 1e-5 (still tiny next to the loss's
    other gradients) fails."""
    mod = importlib.import_module("fuzz_hf")
    mod.main(3514, 1)
    out = capsys.readouterr().out
    assert "float64: within 2x" in out and "CHECK" not in out and "EXC" not in out, out
    step, calls = mod.step, []

    def moved(m, kw):
        loss, grads = step(m, kw)
        calls.append(1)
        if len(calls) == 2:  # (the patched model: the base one steps first)
            grads["model.layers.1.self_attn.q_proj.weight"] += 1e-5
        return loss, grads

    monkeypatch.setattr(mod, "step", moved)
    mod.main(3514, 1)
    out = capsys.readouterr().out
    assert "float64: past 2x" in out and "CHECK" in out, out


def test_repeat_mode(fuzz_path, capsys):
    """A case's shapes with several data sets: one line per result with its median and
    largest error ratio, each draw's data different (the ratios differ) and the shapes the
    same (one description)."""
    mod = importlib.import_module("fuzz_mlp")
    common = importlib.import_module("fuzz_common")
    assert common.run_seeds(mod.run_case, ["x", "3", "1", "3"]) == 0
    out = capsys.readouterr().out
    lines = [ln for ln in out.splitlines() if ln.startswith("  ")]
    assert out.count("seed 3 ") == 1 and len(lines) == 6, out
    assert all("of 3 past" in ln for ln in lines), out
    ratios = common._RATIOS[0]
    assert len(ratios) == 3 and len(set(ratios)) == 3 and max(ratios) < 1, ratios


def test_fuzz_drop_in_autocast_seeds(fuzz_path, capsys, monkeypatch):
    """FUZZ_AUTOCAST=1: float32 models under autocast to fp16, the patched one in the cast
    mode (its default) against autocast's own error: a packed tied Llama and a packed
    Qwen3 batch pass (a wiring check: at seeds 0-39, 6 of 34 cases had one gradient's
    largest element past 2x, none past 2x in relative norm; NOTES.md)."""
    mod = importlib.import_module("fuzz_hf")
    monkeypatch.setattr(mod, "AUTOCAST", True)
    mod.main(4, 1)
    mod.main(11, 1)
    out = capsys.readouterr().out
    assert "autocast to torch.float16" in out and "seed 4" in out and "seed 11" in out, out
    assert "CHECK" not in out and "EXC" not in out, out
