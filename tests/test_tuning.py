"""The tuning cache is plain data: corrupt, stale or foreign files are ignored."""

import json
from dataclasses import asdict

import pytest
import torch

from codetta.kernels import configs, tuning

FMT = tuning.CACHE_FORMAT

IDENT = {"gpu": "NVIDIA H200", "triton": "3.6.0", "codetta": "0.1.0"}


def _write(path, data):
    path.write_text(data if isinstance(data, str) else json.dumps(data))


def test_roundtrip(tmp_path):
    path = tmp_path / "t.json"
    cache = tuning.TuneCache(path, IDENT)
    cfg = configs.PLAIN_CANDIDATES[3]
    cache.put("store|bfloat16|nn|16384|2048|2048", cfg)
    again = tuning.TuneCache(path, IDENT)
    assert again.get("store|bfloat16|nn|16384|2048|2048") == cfg


@pytest.mark.parametrize(
    "content,match",
    [
        ("{not json", "unreadable"),
        ({"format": 99, "identity": IDENT, "entries": {}}, "unreadable"),
        ({"format": FMT, "identity": IDENT, "entries": []}, "unreadable"),
        ({"format": FMT, "identity": IDENT, "entries": {"k": {"block_m": 3}}}, "unreadable"),
        ({"format": FMT, "identity": {**IDENT, "gpu": "other"}, "entries": {}}, "written for"),
        ({"format": FMT, "identity": {**IDENT, "codetta": "0.0.1"}, "entries": {}}, "written for"),
    ],
    ids=["not-json", "format", "entries-type", "bad-config", "other-gpu", "stale-version"],
)
def test_bad_cache_is_ignored(tmp_path, content, match):
    path = tmp_path / "t.json"
    _write(path, content)
    with pytest.warns(UserWarning, match=match):
        cache = tuning.TuneCache(path, IDENT)
    assert cache.entries == {}


def test_values_outside_space_rejected():
    good = asdict(configs.PLAIN_CANDIDATES[0])
    assert configs.config_from_dict(good) == configs.PLAIN_CANDIDATES[0]
    for field, bad in [("num_warps", 7), ("block_n", "256"), ("flatten", 1.0), ("epi_split", 3)]:
        with pytest.raises(ValueError):
            configs.config_from_dict({**good, field: bad})
    with pytest.raises(ValueError):
        configs.config_from_dict({**good, "extra": 1})


def test_tune_picks_fastest_and_skips_failures():
    cands = configs.PLAIN_CANDIDATES[:3]
    times = {cands[0]: 2.0, cands[2]: 1.0}

    def prepare(cfg):
        if cfg not in times:
            raise RuntimeError("out of resources")

        def fn():
            pass

        fn.cfg = cfg
        return fn

    def measure(fns):
        assert set(fns) == set(times)  # failed candidates are not timed
        return {cfg: times[fn.cfg] for cfg, fn in fns.items()}

    assert tuning.tune("k", cands, prepare, measure) == cands[2]


def test_tune_says_where_a_long_key_is(monkeypatch, capsys):
    """A key whose compiles and first runs pass PROGRESS_S prints a line before its
    timing (a 70B-class key sat silent for minutes after "tuning ... over 11 configs");
    a quick one prints only its first and last lines."""
    cands = configs.PLAIN_CANDIDATES[:2]

    def measure(fns):
        return {c: 1.0 for c in fns}

    tuning.tune("quick", cands, lambda cfg: lambda: None, measure)
    assert "timing them" not in capsys.readouterr().err
    monkeypatch.setattr(tuning, "PROGRESS_S", -1.0)
    tuning.tune("long", cands, lambda cfg: lambda: None, measure)
    err = capsys.readouterr().err
    assert "long: compiled in" in err and "2 of 2 ran once" in err and "timing them" in err


def test_scout_keeps_each_mainloops_best():
    """The short scouting round drops the candidates clearly behind the best of their own
    mainloop, so the portable mainloop's best goes on to the full timing even when every
    portable candidate is behind the ping-pong's best (under sustained load, which ``both``
    judges after the scout, it can win: the ping-pong draws more power; and it is the
    CODETTA_PINGPONG=0 key's pick). Until the thirty-sixth session the scout kept only
    those within SCOUT_KEEP of the overall best (here the two fastest ping-pong configs)."""
    pp = [configs.Config(block_n=128, num_warps=4, num_stages=s, pingpong=True) for s in (2, 3, 4, 5)]
    portable = [configs.Config(num_stages=s) for s in (3, 4)]
    quick = {pp[0]: 1.0, pp[1]: 1.05, pp[2]: 1.3, pp[3]: 1.5, portable[0]: 1.2, portable[1]: 1.4}
    timed = []

    def measure(fns):
        timed.extend(fns)
        return {c: quick[c] for c in fns}

    def scout(fns):
        return {c: quick[c] for c in fns}

    times = tuning.tune_times("k", pp + portable, lambda cfg: lambda: None, measure, scout=scout)
    assert sorted(timed, key=quick.get) == [pp[0], pp[1], portable[0]] and set(times) == set(timed)
    # one mainloop alone: as before, within SCOUT_KEEP of its best
    timed.clear()
    tuning.tune_times("k", pp, lambda cfg: lambda: None, measure, scout=scout)
    assert sorted(timed, key=quick.get) == [pp[0], pp[1]]


def test_tune_all_fail():
    def prepare(cfg):
        raise RuntimeError("nope")

    with pytest.raises(RuntimeError, match="no configuration"):
        tuning.tune("k", configs.PLAIN_CANDIDATES[:2], prepare, lambda fns: {c: 1.0 for c in fns})


def test_shape_bucket():
    assert [configs.shape_bucket(x) for x in (1, 2, 3, 16384, 16385)] == [1, 2, 4, 16384, 32768]


def test_tail_splits():
    """How many K parts a partial last wave's tiles get: only when SMs would idle and K is long enough."""
    cfg = configs.Config(tail_split=4)
    assert configs.tail_splits(cfg, 3072, 132, 64, 4) == 3  # 36 tail tiles on 132 SMs
    assert configs.tail_splits(cfg, 8192, 132, 32, 4) == 4  # 8 tail tiles: capped at tail_split
    assert configs.tail_splits(cfg, 8192, 132, 8, 4) == 2  # short K: at least 4 K blocks a part
    assert configs.tail_splits(cfg, 264, 132, 64, 4) == 1  # no partial wave
    assert configs.tail_splits(cfg, 250, 132, 64, 4) == 1  # 118 tail tiles: no room to split
    assert configs.tail_splits(configs.Config(tail_split=1), 3072, 132, 64, 4) == 1


def test_tail_split_opt_out():
    from codetta import Program, Tile
    from codetta.kernels.engines import TRITON
    from codetta.programs import STORE

    prog = Program("no_tail", STORE.body, outputs=(Tile("out"),), tail_split=False)
    assert all(c.tail_split == 1 for c in TRITON.candidates(prog))
    assert any(c.tail_split > 1 for c in TRITON.candidates(STORE))


def test_tuning_workspaces_shared_per_geometry():
    """The tuner's candidates share the outputs, and workspaces per tile geometry (their
    partial shapes depend on it, the finished outputs do not)."""
    from codetta import programs as pg
    from codetta.kernels import launch
    from codetta.kernels.operands import make_call

    M, N = 300, 256
    a16, w16 = torch.zeros(M, 64, dtype=torch.float16), torch.zeros(N, 64, dtype=torch.float16)
    ops = {"residual": torch.zeros(M, N, dtype=torch.float16), "gamma": torch.ones(N)}
    call = make_call(pg.RESIDUAL_RMS, a16, w16, ops)
    a, c = configs.Config(128, 256, 64, 8, 2), configs.Config(128, 256, 64, 8, 4)
    ws_a, ws_c = launch.alloc_workspaces(call, a), launch.alloc_workspaces(call, c)
    assert ws_a[0] is None and ws_a[1] is None  # tiles: the outputs themselves
    assert ws_a[2].shape == (300, 2) and ws_c[2].shape == (300, 4)  # sumsq partials per sub-tile
    assert [o.shape for o in launch.alloc_outputs(call)] == [(M, N), (M, N), (M,)]


def test_rule_config_follows_the_shape():
    """Untuned choices: ping-pong (finest split) for big outputs, the portable 128x256 tiles for
    a vocabulary-wide one, two programs per SM when tiles are few."""
    from codetta import programs as pg
    from codetta.kernels.engines import PINGPONG, TRITON
    from codetta.kernels.operands import make_call

    def call(M, N, K=64, prog=pg.STORE):
        a, w = torch.zeros(M, K, dtype=torch.float16), torch.zeros(N, K, dtype=torch.float16)
        ops = (
            {"residual": torch.zeros(M, N, dtype=torch.float16), "gamma": torch.ones(N)}
            if prog is pg.RESIDUAL_RMS
            else {}
        )
        return make_call(prog, a, w, ops)

    def cands(prog):
        return TRITON.candidates(prog) + PINGPONG.candidates(prog)

    big = tuning.rule_config(call(16384, 4096), cands(pg.STORE))
    assert big.pingpong and big == PINGPONG.candidates(pg.STORE)[-1]
    k1 = tuning.rule_config(call(16384, 4096, prog=pg.RESIDUAL_RMS), cands(pg.RESIDUAL_RMS))
    assert k1.pingpong and k1.epi_split == 4
    vocab = tuning.rule_config(call(8192, 128256), cands(pg.STORE))
    assert not vocab.pingpong and (vocab.block_n, vocab.flatten) == (256, True)
    few = tuning.rule_config(call(2048, 2048), cands(pg.STORE))
    assert few.occupancy == 2
    assert tuning.rule_config(call(64, 256), TRITON.candidates(pg.STORE)).occupancy == 2
    # candidates at two raster row groups (the LM head's logits: configs.with_row_groups):
    # the finest split at the candidates' own group, 8, not the appended 4
    slice_ = tuning.rule_config(call(16384, 32768, prog=pg.CE_LOGITS), cands(pg.CE_LOGITS))
    assert slice_.pingpong and (slice_.epi_split, slice_.group_m) == (2, 8)


def test_pingpong_policy():
    """CODETTA_PINGPONG_POLICY=epilogue-bound keeps a light epilogue at long K on the
    portable mainloop; heavy epilogues (tile inputs, a paired weight, a float32 ring, a
    row table, a log-sum-exp) and short K keep the ping-pong candidates."""
    from codetta import programs as pg
    from codetta.kernels import settings
    from codetta.kernels.operands import make_call

    assert settings.Settings.from_env({}).pingpong_policy == "all"
    assert settings.Settings.from_env({"CODETTA_PINGPONG_POLICY": "epilogue-bound"}).pingpong_policy == (
        "epilogue-bound"
    )
    with pytest.raises(ValueError, match="CODETTA_PINGPONG_POLICY"):
        settings.Settings.from_env({"CODETTA_PINGPONG_POLICY": "some"})

    def call(prog, K, **ops):
        M, N, h = 256, 128, torch.float16
        a, w = torch.zeros(M, K, dtype=h), torch.zeros(N, K, dtype=h)
        return make_call(prog, a, w, ops)

    M, N = 256, 128
    tile = torch.zeros(M, N, dtype=torch.float16)
    assert not tuning.pingpong_pays(call(pg.STORE, 8192))
    assert not tuning.pingpong_pays(call(pg.ACCUMULATE, 8192, c=tile))
    assert not tuning.pingpong_pays(call(pg.RESIDUAL_RMS, 8192, residual=tile, gamma=torch.ones(N)))
    assert tuning.pingpong_pays(call(pg.STORE, 2048))  # short K
    assert tuning.pingpong_pays(call(pg.DSWIGLU, 8192, g=tile, u=tile))  # tile inputs
    assert tuning.pingpong_pays(call(pg.ACCUMULATE_F32, 8192, c=tile.float()))  # float32 ring
    assert tuning.pingpong_pays(call(pg.CE_LOGITS, 8192))  # a row log-sum-exp
    assert tuning.pingpong_pays(call(pg.SWIGLU_RMS, 8192, up=torch.zeros(N, 8192, dtype=torch.float16),
                                     sumsq=torch.ones(M), inv_d=1.0, eps=1e-6))  # fmt: skip
    # on a CPU the ping-pong mainloop cannot run, whatever the policy
    with settings.override(pingpong_policy="all"):
        assert not tuning.pingpong_allowed(call(pg.DSWIGLU, 8192, g=tile, u=tile))
    # the tune command keys a model's calls as the launcher would under the policy
    from codetta import models, tune

    with settings.override(pingpong_policy="epilogue-bound"):
        keys = tune.model_calls(models.widths_of("llama3-1b"), (16384,))
    light = {k.split("@")[0] for k in keys if k.endswith("|no-pingpong")}
    assert light == {"store", "store_k2", "residual_rms"}  # store_k2: the MLP norm's dX, K 2 x 8192
    default = tune.model_calls(models.widths_of("llama3-1b"), (16384,))
    assert not any(k.endswith("|no-pingpong") for k in default)


def test_chooser_follows_the_settings(tmp_path, monkeypatch):
    """The chooser keeps one user cache per cache folder, and its per-call memo per
    settings: an A/B variant under other settings (bench --tuned-ab) picks for itself,
    and the first settings find their pick again."""
    from codetta import programs as pg
    from codetta.kernels.operands import make_call
    from codetta.kernels.settings import SETTINGS, override

    monkeypatch.setattr(tuning.device, "name", lambda index: "NVIDIA H200")
    monkeypatch.setattr(tuning.device, "interpreting", lambda: False)
    chooser = tuning.Chooser()
    with override(cache_dir=tmp_path / "a"):
        a = chooser.cache(0)
        assert chooser.cache(0) is a
    with override(cache_dir=tmp_path / "b"):
        assert chooser.cache(0) is not a and chooser.cache(0).path == tmp_path / "b" / "tuning.json"
    picks = []
    chooser._pick = lambda call, prepare, pp: picks.append(SETTINGS.shipped) or configs.PLAIN_CANDIDATES[0]
    a = torch.zeros(64, 32, dtype=torch.float16)
    call = make_call(pg.STORE, a, a, {})
    chooser.choose(call, None)
    chooser.choose(call, None)
    with override(shipped=False):
        chooser.choose(call, None)
    chooser.choose(call, None)
    assert picks == [True, False]


def test_sweep_picks_per_mainloop_choice():
    """A sweep over both mainloops settles two keys: the fastest under the call's key, and
    the fastest portable configuration under its CODETTA_PINGPONG=0 key; a portable-only
    sweep settles one."""
    from codetta import programs as pg
    from codetta.kernels.operands import make_call

    a = torch.zeros(64, 32, dtype=torch.float16)
    call = make_call(pg.STORE, a, a, {})
    port, pp = configs.PLAIN_CANDIDATES[:2], configs.PINGPONG_CANDIDATES[0]
    times = {port[0]: 2.0, port[1]: 1.5, pp: 1.0}
    chooser = tuning.Chooser()
    assert chooser.picks(call, True, times) == {
        chooser.key(call, True): pp,
        chooser.key(call, False): port[1],
    }
    assert chooser.picks(call, False, {port[0]: 2.0, port[1]: 1.5}) == {chooser.key(call, False): port[1]}
