"""The device-call scripts' own logic (shell), with the GPU's tools stubbed out: no GPU,
no real tuning."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def stub_path(tmp_path):
    """A PATH whose python3 and nvidia-smi only record their arguments (and exit 0)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for tool in ("python3", "nvidia-smi"):
        stub = bin_dir / tool
        stub.write_text(f'#!/bin/sh\necho "{tool} $*" | tee -a "{tmp_path}/calls.txt"\n')
        stub.chmod(0o755)
    return f"{bin_dir}:{os.environ['PATH']}"


def _tune(out: Path, path: str, scope: str, **extra) -> None:
    env = {**os.environ, "PATH": path, "OUT": str(out), "TUNE_MERGE": "1", "TUNE_SCOPE": scope, **extra}
    env.pop("PYTHONPATH", None)
    cmd = ["bash", "scripts/gpu_call.sh", "tune"]
    subprocess.run(cmd, cwd=ROOT, env=env, check=True, capture_output=True)


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
def test_chained_tunes_add_up(tmp_path, stub_path):
    """Two tunes in one device call with TUNE_MERGE: the first starts from the shipped
    tables, the second from the first's result in $OUT (run 272 lost its first tune's keys
    when the second copied the shipped table over them); each tune's log is kept."""
    out = tmp_path / "out"
    _tune(out, stub_path, "--model a")
    shipped = sorted(p.name for p in (ROOT / "codetta/kernels/tuned").glob("*.json"))
    assert sorted(p.name for p in (out / "tuned").glob("*.json")) == shipped
    first = out / "tuned" / shipped[0]
    first.write_text('{"tuned": "by the first call"}')  # (what the first tune wrote)
    _tune(out, stub_path, "--model b")
    assert first.read_text() == '{"tuned": "by the first call"}'
    calls = (tmp_path / "calls.txt").read_text()
    assert "-m codetta tune --model a" in calls and "-m codetta tune --model b" in calls
    assert calls.count("--merge") == 2
    logs = (out / "tune-all.txt").read_text()
    assert "tune --model a" in logs and "tune --model b" in logs
    assert "--model a" not in (out / "tune.txt").read_text()  # (tune.txt: the last tune's)


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
def test_tune_gets_a_time_limit_under_the_hard_one(tmp_path, stub_path):
    """The tune stops itself 30 s under TUNE_TIMEOUT (half of it when that is short), and a
    TUNE_TIMEOUT that is not whole seconds (5m) goes to ``timeout`` alone: the tune still runs."""
    for timeout, want in (("300", "--time-limit 270"), ("40", "--time-limit 20"), ("5m", None)):
        calls = tmp_path / "calls.txt"
        calls.unlink(missing_ok=True)
        _tune(tmp_path / f"out{timeout}", stub_path, "--model a", TUNE_TIMEOUT=timeout)
        line = next(x for x in calls.read_text().splitlines() if "-m codetta tune" in x)
        assert (want in line) if want else "--time-limit" not in line, line


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
def test_bench_log_names_its_gpu(tmp_path, stub_path):
    """bench.txt starts with the call's GPU and versions (env.txt), once over two bench
    steps, so that its "codetta: tuned" lines serve ``merge_tuned.py --from-log`` (run 339:
    the printed tail cut the tuned lines, and bench.txt named no GPU)."""
    out = tmp_path / "out"
    env = {**os.environ, "PATH": stub_path, "OUT": str(out)}
    env.pop("PYTHONPATH", None)
    cmd = ["bash", "scripts/gpu_call.sh", "bench:ce", "bench:mlp"]
    subprocess.run(cmd, cwd=ROOT, env=env, check=True, capture_output=True)
    head = (out / "env.txt").read_text()
    bench = (out / "bench.txt").read_text()
    assert "nvidia-smi --query-gpu=name" in head and bench.startswith(head)
    assert bench.count(head) == 1
    assert "--parts ce" in bench and "--parts mlp" in bench


def test_rowsq_probe_checks_its_variants():
    """``scripts/rowsq_probe.py --check`` (the interpreter): the three ways of forming the
    norm's rstd beside the GEMM (a pass first, summed in the K loop per step, or into a tile
    accumulator) each within 2x PyTorch's float16 error of float64; the GPU timing is
    meaningless if one of them is wrong (a wrong divisor in the in-loop rstd fails 4 of 6)."""
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    cmd = [sys.executable, "scripts/rowsq_probe.py", "--check"]
    res = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout + res.stderr
    assert res.stdout.count(" ok") == 6 and "FAIL" not in res.stdout, res.stdout
