"""The shipped tuned table, the tuning plan of a model's step, the choice without tuning."""

import json
from dataclasses import asdict

import pytest
import torch
import triton
from util import load_script

from codetta import models, tune
from codetta.kernels import configs, settings, tuning
from codetta.kernels.engines import PINGPONG, TRITON
from codetta.programs import RMS_SCALE, STORE

H200 = ("NVIDIA H200", (9, 0), 132)
H100 = ("NVIDIA H100 80GB HBM3", (9, 0), 132)
FIELDS = ("hidden", "intermediate", "heads", "kv_heads", "head_dim", "vocab", "tied")


def _tables():
    return sorted(tuning.SHIPPED_DIR.glob("*.json"))


def _call(M=16384, N=512, K=2048, program=RMS_SCALE, dtype=torch.bfloat16):
    """A stand-in for a GEMM call as the chooser reads one (no tensors; on the CPU)."""
    import types

    return types.SimpleNamespace(program=program, dtype=dtype, a_t=False, b_t=False, M=M, N=N, k_total=K,
                                 device=torch.device("cpu"))  # fmt: skip


def test_shipped_tables_are_well_formed():
    """Every shipped table loads as plain data: the format, an identity naming the GPU,
    its architecture, SM count and Triton version, and entries that are valid configs."""
    assert _tables(), "no tuned table is shipped"
    for path in _tables():
        data = json.loads(path.read_text())
        assert data["format"] == tuning.CACHE_FORMAT
        ident = data["identity"]
        assert set(ident) == {"gpu", "capability", "num_sms", "triton"}
        assert set(data) <= {"format", "identity", "entries", "pending"}
        assert path.stem == configs.gpu_slug(ident["gpu"])
        assert data["entries"], f"{path.name} is empty"
        for key, cfg in data["entries"].items():
            head, dims, tail = tuning._split_key(key)
            assert dims is not None and len(dims) == 3 and tail in ("", "no-pingpong"), key
            configs.config_from_dict(cfg)  # raises on anything outside the configuration space


@pytest.mark.parametrize("gpu", [H200, H100], ids=["h200", "h100"])
@pytest.mark.parametrize("name", sorted(models.KNOWN))
def test_known_models_hit_the_shipped_table(name, gpu):
    """Every GEMM a listed model's training step runs through codetta, at every token
    bucket, has an entry in the GPU's own table, or is listed there as pending (tuning cut
    short by device time; the table says so itself). The keys come from recording the
    operators, so an edited program body or a new call in an operator fails here until the
    table is redone."""
    data = json.loads((tuning.SHIPPED_DIR / f"{configs.gpu_slug(gpu[0])}.json").read_text())
    entries = data["entries"]
    pending = set(data.get("pending", ()))
    assert not pending & set(entries), "a key is both tuned and pending"
    keys = tune.model_calls(models.KNOWN[name], tune.TOKEN_BUCKETS)
    unknown = sorted(k for k in keys if k not in entries and k not in pending)
    assert not unknown, (
        f"{len(unknown)} of {len(keys)} keys neither tuned nor pending, e.g. {unknown[:3]} (a program or the "
        "drop-in's plan changed: python -m codetta tune --all-known --pending --out "
        f"codetta/kernels/tuned/{configs.gpu_slug(gpu[0])}.json lists them, tune --merge on a GPU tunes them)"
    )


def test_similar_gpu_uses_the_table_and_other_triton_does_not(tmp_path, monkeypatch, shipped_triton):
    """An H100 takes its own table's picks and the H200's (same architecture and SM count)
    for the keys its own lacks, and the H200 the reverse; another H100 kind (PCIe: 114 SMs)
    takes neither; a table tuned under another Triton minor version is not used; a broken
    file warns."""
    own = {g: {k: configs.config_from_dict(v) for k, v in json.loads(
        (tuning.SHIPPED_DIR / f"{configs.gpu_slug(g[0])}.json").read_text())["entries"].items()}
        for g in (H100, H200)}  # fmt: skip
    h100, h200 = tuning.shipped_table(*H100), tuning.shipped_table(*H200)
    assert h100 == {**own[H200], **own[H100]} and h200 == {**own[H100], **own[H200]}
    assert h100 != h200, "the H100 table picks like the H200's everywhere: nothing to test"
    # (which entries are lent: an H100 tunes those anew, ``codetta.tune``; its own are not)
    assert h100.borrowed == {k: H200[0] for k in set(own[H200]) - set(own[H100])}
    assert h200.borrowed == {k: H100[0] for k in set(own[H100]) - set(own[H200])}
    key = next(iter(h100.borrowed))
    assert h100.source(key) == "shipped (H200's)" and h100.source(next(iter(own[H100]))) == "shipped"
    assert tuning.shipped_table("NVIDIA H100 PCIe", (9, 0), 114) == {}
    assert tuning.shipped_table("NVIDIA A100", (8, 0), 108) == {}
    cfg = asdict(configs.PLAIN_CANDIDATES[0])
    ident = {"gpu": "X", "capability": [9, 0], "num_sms": 132, "triton": "2.9.0"}
    (tmp_path / "x.json").write_text(json.dumps({"format": tuning.CACHE_FORMAT, "identity": ident,
                                                 "entries": {"store|bfloat16|nn|1|1|1": cfg}}))  # fmt: skip
    (tmp_path / "y.json").write_text("{broken")
    monkeypatch.setattr(tuning, "SHIPPED_DIR", tmp_path)
    with pytest.warns(UserWarning, match="y.json"):
        assert tuning.shipped_table("X", (9, 0), 132) == {}


def test_tables_lend_both_ways(tmp_path, monkeypatch):
    """Two GPUs of one architecture and SM count: each takes its own table's picks and the
    other's for the keys its own lacks, and knows which those are; a GPU of another SM
    count takes neither (its own table, or a lent one of its kind); a GPU's own table is
    found by its name alone."""
    c0, c1 = (asdict(c) for c in configs.PLAIN_CANDIDATES[:2])
    for gpu, entries, sms in (("A", {"x": c0, "y": c0}, 132), ("B", {"y": c1, "z": c1}, 132),
                              ("C", {"w": c0}, 114)):  # fmt: skip
        ident = {"gpu": gpu, "capability": [9, 0], "num_sms": sms, "triton": triton.__version__}
        (tmp_path / f"{gpu}.json").write_text(json.dumps({"format": tuning.CACHE_FORMAT, "identity": ident,
                                                          "entries": entries}))  # fmt: skip
    monkeypatch.setattr(tuning, "SHIPPED_DIR", tmp_path)
    p0, p1 = configs.PLAIN_CANDIDATES[:2]
    a, b = tuning.shipped_table("A", (9, 0), 132), tuning.shipped_table("B", (9, 0), 132)
    assert a == {"x": p0, "y": p0, "z": p1} and a.borrowed == {"z": "B"}
    assert b == {"x": p0, "y": p1, "z": p1} and b.borrowed == {"x": "A"}
    c = tuning.shipped_table("C", (9, 0), 114)
    assert c == {"w": p0} and c.borrowed == {}
    d = tuning.shipped_table("D", (9, 0), 114)
    assert d == {"w": p0} and d.borrowed == {"w": "C"}
    assert tuning.shipped_table("E", (9, 0), 100) == {}
    assert tuning.shipped_table("A", (8, 0), 132) == {"x": p0, "y": p0}


def test_known_names_a_lent_entry(monkeypatch):
    """``Chooser.known`` says which entries another GPU's table lent (``codetta.tune``, the
    ``tune`` command and tuning on the hot path tune those anew, so an H100 table holds
    only the H100's picks)."""
    import types

    from codetta.kernels import settings

    chooser = tuning.Chooser()
    cands = TRITON.candidates(RMS_SCALE)
    call = _call()
    entries = tuning.ShippedEntries({chooser.key(call, False): cands[0]})
    monkeypatch.setattr(chooser, "shipped", lambda index: entries)
    monkeypatch.setattr(chooser, "cache", lambda index: types.SimpleNamespace(entries={}))
    assert chooser.known(call, False, cands) == (cands[0], "shipped")
    assert chooser.known(call, False, cands, lent=False) == (cands[0], "shipped")
    entries.borrowed[chooser.key(call, False)] = "NVIDIA H200"
    assert chooser.known(call, False, cands) == (cands[0], "shipped (H200's)")
    assert chooser.known(call, False, cands, lent=False) == (None, "")
    # the choice: the lent pick unless tuning is on (CODETTA_AUTOTUNE=1), which tunes it anew
    monkeypatch.setattr(tuning, "candidates", lambda call, pingpong: cands)
    monkeypatch.setattr(tuning, "capturing", lambda dev: False)
    monkeypatch.setattr(chooser, "tune", lambda call, prepare, pp, cands, seconds: "tuned here")
    with settings.override(autotune=False):
        assert chooser._pick(call, None, False) == cands[0]
    with settings.override(autotune=True):
        assert chooser._pick(call, None, False) == "tuned here"
        entries.borrowed.clear()  # (its own table's pick: not tuned again)
        assert chooser._pick(call, None, False) == cands[0]


def test_model_calls_cover_the_step():
    """The recorded plan of a layer, as the Hugging Face drop-in calls the operators: K1
    and the scaled next GEMMs forward (gate and up paired with SwiGLU, q and k with RoPE,
    v as separate weights); dX (dSwiGLU in the down projection's, summed over the next
    GEMMs in one launch: K parts), dW, dy and dW_o backward; the LM head + loss per chunk of
    rows; the token count (or the chunk's rows) lands wherever the probe's did (M, or K
    of dW)."""
    w = models.KNOWN["llama3-8b"]
    calls = tune.model_calls(w, (16384,))
    progs = {c.program.name for c in calls.values()}
    assert progs == {"residual_rms", "rms_scale", "store", "store_k2", "store_k3", "ce_logits_scaled",
                     "store_f32", "accumulate_f32", "finish_f32", "swiglu_rms", "dswiglu_y", "rms_rope_128",
                     "residual_rms_f32"}  # fmt: skip
    shapes = {(c.program.name, c.a_t, c.b_t, c.M, c.N, c.K) for c in calls.values()}
    assert ("residual_rms", False, False, 16384, 4096, 4096) in shapes  # o_proj + residual
    # the same over a float32 stream (the cast mode under autocast), and down + residual
    assert ("residual_rms_f32", False, False, 16384, 4096, 4096) in shapes
    assert ("residual_rms_f32", False, False, 16384, 4096, 14336) in shapes
    assert ("swiglu_rms", False, False, 16384, 14336, 4096) in shapes  # gate and up, paired
    # down's dX + dSwiGLU, y formed again (CODETTA_SWIGLU_KEEP_Y=auto at d 4096; kept at 2048)
    assert ("dswiglu_y", False, True, 16384, 14336, 4096) in shapes
    assert "dswiglu" in {
        c.program.name for c in tune.model_calls(models.KNOWN["llama3-1b"], (16384,)).values()
    }
    assert ("rms_rope_128", False, False, 16384, 1024, 4096) in shapes  # k (q: N 4096)
    assert ("rms_scale", False, False, 16384, 1024, 4096) in shapes  # v
    # LM head + loss, 4096-row chunks, the final norm's rstd as the logits' row scale
    assert ("ce_logits_scaled", False, False, 4096, 128256, 4096) in shapes
    with settings.override(ce_norm_factors=False):  # (n formed: the plain logits program)
        plain = tune.model_calls(w, (16384,))
    assert ("ce_logits", False, False, 4096, 128256, 4096) in {
        (c.program.name, c.a_t, c.b_t, c.M, c.N, c.K) for c in plain.values()
    }
    assert ("store_f32", True, True, 128256, 4096, 4096) in shapes  # its dW, the first chunk
    assert ("accumulate_f32", True, True, 128256, 4096, 4096) in shapes  # the others, summed in place
    assert ("store_k2", False, True, 16384, 4096, 14336) in shapes  # dh = d(gate) W_gate + d(up) W_up
    assert ("store_k3", False, True, 16384, 4096, 4096) in shapes  # dh = dq Wq + dk Wk + dv Wv
    assert ("store", True, True, 14336, 4096, 16384) in shapes  # dW of gate (and up)
    for c in calls.values():
        assert 104 not in (c.M, c.N, c.K), "a probe dimension was left unscaled"


def test_model_calls_of_widths_equal_to_the_probe_dims():
    """A model whose widths equal the probes' default dimensions (104 tokens; 152 the LM
    head's vocabulary; 208 and 312 its 2-3 chunks of rows) is probed with other ones, so that
    its widths stay as they are and only the token count and vocabulary are scaled."""
    w = models.Widths("odd", 104, 152, 2, 1, 104, 312)  # d 104, f 152, q 208, kv 104, V 312
    assert tune._probe_dims(models.KNOWN["llama3-8b"]) == (tune._PROBE_TOKENS, tune._PROBE_VOCAB)
    T, V = tune._probe_dims(w)
    assert (T, V) != (tune._PROBE_TOKENS, tune._PROBE_VOCAB) and T % 8 == V % 8 == 0
    shapes = {(c.program.name, c.a_t, c.b_t, c.M, c.N, c.K) for c in tune.model_calls(w, (4096,)).values()}
    assert ("residual_rms", False, False, 4096, 104, 208) in shapes  # o_proj + residual
    assert ("swiglu_rms", False, False, 4096, 152, 104) in shapes  # gate and up
    assert ("store", True, True, 104, 152, 4096) in shapes  # dW of down
    # the LM head: every row in one chunk at V 312 (its rows as its own dW GEMM's K)
    assert ("ce_logits_scaled", False, False, 4096, 312, 104) in shapes
    for c in tune.model_calls(w, (4096,)).values():
        assert not {T, V} & {c.M, c.N, c.K}, "a probe dimension was left unscaled"


def test_one_launch_calls_recreate():
    """Under CODETTA_QKV_ONE_LAUNCH the recorded plan has the one-launch programs (q, k, v:
    N parts; their dW: M parts), and the tuner's fresh inputs make the same calls (a and the
    weight hold what the parts leave of M and N)."""
    from codetta.kernels import settings
    from codetta.kernels.operands import make_call

    with settings.override(qkv_one_launch=True):
        calls = tune.model_calls(models.KNOWN["llama3-1b"], (4096,))
    parts = [c for c in calls.values() if c.program.name in ("rms_rope_64_n3", "store_m3")]
    assert sorted(c.program.name for c in parts) == ["rms_rope_64_n3", "store_m3"]
    for rec in parts:
        a, w, ops = tune.call_inputs(rec, device="cpu")
        call = make_call(rec.program, a, w, ops)
        assert (
            (call.M, call.N, call.k_total)
            == (rec.M, rec.N, rec.k_total)
            == ((4096, 3072, 2048) if rec.program.name == "rms_rope_64_n3" else (3072, 2048, 4096))
        )


def test_widths_from_hf_config(tmp_path):
    cfg = {"hidden_size": 2048, "intermediate_size": 8192, "num_attention_heads": 32,
           "num_key_value_heads": 8, "vocab_size": 128256, "tie_word_embeddings": True}  # fmt: skip
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    got = models.widths_of(tmp_path / "config.json")
    want = models.KNOWN["llama3-1b"]
    assert got == models.Widths(str(tmp_path.name), *[getattr(want, f) for f in FIELDS])
    assert models.widths_of(str(tmp_path)) == got
    with pytest.raises(ValueError, match="lacks"):
        models.widths_of({"hidden_size": 8})
    with pytest.raises(TypeError):
        models.widths_of(3)
    # a file that is not a JSON object, or not JSON, named; a name that cannot be a hub
    # name refused at once (no hub retries for a typo)
    (tmp_path / "list.json").write_text("[1, 2]")
    (tmp_path / "bad.json").write_text("{hidden_size: 8}")
    (tmp_path / "bias.json").write_text(json.dumps({**cfg, "attention_bias": True}))
    for spec, why in (
        (tmp_path / "list.json", "list.json: not a model config .a JSON object., got a JSON list"),
        (tmp_path / "bad.json", "bad.json: not a JSON model config"),
        ("llama3-xyz", "nor a hub name"),
        (tmp_path / "bias.json", "has attention_bias: codetta adds the q, k and v projections' biases only"),
        (str(tmp_path / "none.json"), "no such file"),
    ):
        with pytest.raises(ValueError, match=why):
            models.widths_of(str(spec))


@pytest.mark.parametrize("name", sorted(models.KNOWN))
def test_known_models_make_their_configs(name):
    """``codetta train --model NAME`` builds each known model's family config (Qwen2.5's a
    Qwen2Config, whose q, k and v projections have biases; Qwen3's with q/k norms), whose
    widths read back as the known ones."""
    transformers = pytest.importorskip("transformers")
    from codetta.train import hf_config

    want = models.KNOWN[name]
    cfg = hf_config(name, 1, 64, 16)
    own = name.split("-")[0].rstrip("0123456789").capitalize()  # (llama3 -> Llama)
    own = "Phi3" if own == "Phi" else own  # (Phi-4's model type is phi3)
    family = "Qwen3" if want.qk_norm else "Qwen2" if want.qkv_bias else own
    assert type(cfg).__name__ == f"{family}Config"
    got = models.widths_of(hf_config(name, 1, None, 16))
    fields = (*FIELDS, "qk_norm", "qkv_bias")
    assert [getattr(got, f) for f in fields] == [getattr(want, f) for f in fields]
    if want.hidden <= 1024:  # (a layer of the smallest ones: the biases are there)
        attn = transformers.AutoModelForCausalLM.from_config(cfg).model.layers[0].self_attn
        assert (attn.q_proj.bias is not None) == want.qkv_bias and attn.o_proj.bias is None


def test_partial_rotary_tunes_unrotated_q_and_k():
    """A config with a partial rotary factor (Phi-4-mini's 0.75) reads as ``partial_rotary``,
    and its tuning keys are the drop-in's: q and k by the norm's row scale alone (Hugging
    Face rotates them), no RoPE program."""
    cfg = {"model_type": "phi3", "hidden_size": 3072, "intermediate_size": 8192, "num_attention_heads": 24,
           "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 200064,
           "rope_parameters": {"rope_type": "default", "partial_rotary_factor": 0.75}}  # fmt: skip
    w = models.widths_of(cfg)
    assert w.partial_rotary and not models.widths_of({**cfg, "rope_parameters": {}}).partial_rotary
    names = {c.program.name for c in tune.model_calls(w, (16384,)).values()}
    assert "rms_scale" in names and not [n for n in names if "rope" in n], names
    full = {
        c.program.name
        for c in tune.model_calls(models.widths_of({**cfg, "rope_parameters": {}}), (16384,)).values()
    }
    assert "rms_rope_128" in full


def test_nearest_entry():
    """Without tuning, the closest tuned shape of the same program, dtype, layout and
    mainloop choice lends its config, if that config is a candidate of the call."""
    cands = TRITON.candidates(STORE) + PINGPONG.candidates(STORE)
    a, b, c = cands[0], cands[1], cands[-1]
    entries = {
        "store@x|bfloat16|nn|16384|4096|4096": a,
        "store@x|bfloat16|nn|65536|4096|4096": b,
        "store@x|bfloat16|nt|16384|8192|4096": c,  # another layout
        "store@x|bfloat16|nn|16384|8192|4096|no-pingpong": c,  # another mainloop choice
    }
    assert tuning.nearest("store@x|bfloat16|nn|16384|8192|4096", cands, entries) == a
    assert tuning.nearest("store@x|bfloat16|nn|65536|8192|4096", cands, entries) == b
    assert tuning.nearest("store@x|float16|nn|16384|8192|4096", cands, entries) is None
    assert (
        tuning.nearest("store@x|bfloat16|nn|16384|4096|4096", TRITON.candidates(RMS_SCALE)[:0], entries)
        is None
    )


def test_bias_programs_take_their_siblings_tuned_configs(monkeypatch):
    """An untuned shape of a program with ``tuned_like`` (Qwen2's q/k/v with their biases)
    takes the nearest tuned entry of that program (its own nearer entries win), not the
    shape rule."""
    import types

    from codetta.kernels import settings
    from codetta.programs import RMS_ROPE_128, RMS_ROPE_BIAS_128

    assert RMS_ROPE_BIAS_128.tuned_like is RMS_ROPE_128
    chooser = tuning.Chooser()
    cands = TRITON.candidates(RMS_ROPE_BIAS_128) + PINGPONG.candidates(RMS_ROPE_BIAS_128)
    assert cands == TRITON.candidates(RMS_ROPE_128) + PINGPONG.candidates(RMS_ROPE_128)
    assert len(cands) >= 2
    call = _call(N=4096, K=4096, program=RMS_ROPE_BIAS_128)
    plain = types.SimpleNamespace(**{**vars(call), "program": RMS_ROPE_128})
    sibling = chooser.key(plain, True)
    entries = {sibling: cands[-1]}
    monkeypatch.setattr(chooser, "shipped", lambda index: entries)
    monkeypatch.setattr(chooser, "cache", lambda index: types.SimpleNamespace(entries={}))
    with settings.override(prefer_pingpong=False):
        assert chooser.untuned(call, True, cands) == cands[-1]
        # the bias program's own entry at the same distance wins
        entries[chooser.key(call, True)] = cands[0]
        assert chooser.untuned(call, True, cands) == cands[0]
        # a nearer entry of the sibling wins over a farther one of its own
        far = types.SimpleNamespace(**{**vars(call), "M": 65536})
        entries.clear()
        entries.update({chooser.key(far, True): cands[0], sibling: cands[-1]})
        assert chooser.untuned(call, True, cands) == cands[-1]


def test_an_untuned_layout_takes_another_layouts_entry(monkeypatch):
    """A call whose layout has no entry at all for its program (the plain GEMM in layout nn,
    which no model step runs: run 323) takes the nearest entry of the program's other
    layouts, not the shape rule; an entry of its own layout, however far, still wins, and
    with no entry in any layout the shape rule serves."""
    import types

    chooser = tuning.Chooser()
    cands = TRITON.candidates(STORE) + PINGPONG.candidates(STORE)
    call = _call(N=16384, K=2048, program=STORE)  # (layout nn)
    rule = tuning.rule_config(call, cands)
    nt = next(c for c in cands if c != rule)
    tt = next(c for c in cands if c not in (rule, nt))
    own_far = next(c for c in cands if c not in (rule, nt, tt))

    def key(c, a_t, b_t, M=call.M):
        return chooser.key(types.SimpleNamespace(**{**vars(c), "a_t": a_t, "b_t": b_t, "M": M}), True)

    entries = {key(call, False, True): nt, key(call, True, True, M=65536): tt}
    monkeypatch.setattr(chooser, "shipped", lambda index: entries)
    monkeypatch.setattr(chooser, "cache", lambda index: types.SimpleNamespace(entries={}))
    with settings.override(prefer_pingpong=False):
        assert chooser.untuned(call, True, cands) == nt  # (the nearer of the two other layouts)
        entries[key(call, False, False, M=256)] = own_far
        assert chooser.untuned(call, True, cands) == own_far
        entries.clear()
        assert chooser.untuned(call, True, cands) == rule


def test_chooser_records_where_each_pick_came_from(monkeypatch, capsys):
    """``Chooser.served``: per key, where its configuration came from (its GPU's own table,
    another GPU's, tuning now, the nearest entry, the shape rule), and the benchmark's line
    naming every key that was not this GPU's own (``harness.config_sources``)."""
    import types

    from codetta.bench import harness
    from codetta.bench.harness import config_sources

    chooser = tuning.Chooser()
    cands = TRITON.candidates(RMS_SCALE)
    monkeypatch.setattr(tuning, "candidates", lambda call, pingpong: cands)
    monkeypatch.setattr(tuning, "capturing", lambda dev: False)
    monkeypatch.setattr(tuning, "_capturing", lambda call: False)
    monkeypatch.setattr(chooser, "tune", lambda call, prepare, pp, cands, seconds: cands[1])

    own, lent, near = _call(16384), _call(4096), _call(8192)
    entries = tuning.ShippedEntries({chooser.key(own, False): cands[0], chooser.key(lent, False): cands[0]})
    entries.borrowed[chooser.key(lent, False)] = "NVIDIA H200"
    monkeypatch.setattr(chooser, "shipped", lambda index: entries)
    monkeypatch.setattr(chooser, "cache", lambda index: types.SimpleNamespace(entries={}))
    with settings.override(autotune=False, prefer_pingpong=False):
        for c in (own, lent, near):
            chooser._pick(c, None, False)
        entries.clear()
        entries.borrowed.clear()
        chooser._pick(_call(256), None, False)  # (no entry at all: the shape rule)
    with settings.override(autotune=True):
        chooser._pick(_call(65536), None, False)
    assert chooser.served == {
        chooser.key(own, False): "shipped",
        chooser.key(lent, False): "shipped (H200's)",
        chooser.key(near, False): "nearest entry",
        chooser.key(_call(256), False): "shape rule",
        chooser.key(_call(65536), False): "tuned now",
    }
    others = set(chooser.served) - {chooser.key(own, False)}
    assert chooser.sources(seen=others) == {"shipped": [chooser.key(own, False)]}
    monkeypatch.setattr(harness, "CHOOSER", chooser)
    line = config_sources(seen={chooser.key(_call(65536), False)})
    counts = "1 nearest entry, 1 shape rule, 1 shipped, 1 shipped (H200's)"
    assert line.startswith(f"GEMM configurations: {counts}; not this GPU's own: ")
    for c, why in ((lent, "shipped (H200's)"), (near, "nearest entry"), (_call(256), "shape rule")):
        assert f"{chooser.key(c, False)} ({why})" in line
    assert chooser.key(own, False) not in line and chooser.key(_call(65536), False) not in line
    assert config_sources(seen=set(chooser.served)) is None
    harness.print_config_sources(seen={chooser.key(_call(65536), False)}, case="a case")
    harness.print_config_sources(seen=set(chooser.served), case="a case")  # (nothing new: no line)
    assert capsys.readouterr().out == f"  a case: {line}\n"


def test_the_nearest_entry_is_looked_up_once_per_tuning_key(monkeypatch):
    """A call whose key no table or cache holds takes the nearest entry: a scan of the whole
    table, once per tuning key, not once per token count (run 296, an H100: 3.2 ms of host
    time on every call of a new token count). Another count of the same buckets takes the
    remembered entry; ``clear()`` and a tuning forget it; the shape rule, which reads the
    exact shape, still runs for each count without an entry."""
    import types

    from codetta.kernels import configs, settings

    chooser = tuning.Chooser()
    cands = TRITON.candidates(RMS_SCALE)
    monkeypatch.setattr(tuning, "candidates", lambda call, pingpong: cands)
    scans = []
    real = tuning._nearest
    monkeypatch.setattr(tuning, "_nearest", lambda *args: scans.append(args[0]) or real(*args))

    entries = {chooser.key(_call(16384), False): cands[1]}
    monkeypatch.setattr(chooser, "shipped", lambda index: entries)
    monkeypatch.setattr(chooser, "cache", lambda index: types.SimpleNamespace(entries={}))
    m1, m2 = 5000, 5001
    assert configs.shape_bucket(m1) == configs.shape_bucket(m2) != configs.shape_bucket(16384)
    with settings.override(autotune=False, prefer_pingpong=False):
        assert chooser._pick(_call(m1), None, False) == cands[1]
        per_key = len(scans)
        assert per_key >= 1
        assert chooser._pick(_call(m2), None, False) == cands[1]
        assert len(scans) == per_key  # (remembered)
        assert chooser.served[chooser.key(_call(m2), False)] == "nearest entry"
        chooser.clear()  # (forgets the memo: the entries may have changed)
        entries.clear()
        assert chooser._pick(_call(m2 + 1), None, False) == tuning.rule_config(_call(m2 + 1), cands)
        empty = len(scans) - per_key  # (no entry in the call's layout: the other layouts too)
        assert empty >= per_key
        # no entry: remembered as none, the shape rule per count (it reads the exact M)
        few, many = _call(5000, 768), _call(6000, 768)
        assert configs.shape_bucket(few.M) == configs.shape_bucket(many.M)
        assert tuning.rule_config(few, cands) != tuning.rule_config(many, cands)  # (tiles against SMs)
        assert chooser._pick(few, None, False) == tuning.rule_config(few, cands)
        assert chooser._pick(many, None, False) == tuning.rule_config(many, cands)
        assert len(scans) == per_key + 2 * empty


def test_a_tuning_forgets_the_remembered_nearest_entries(monkeypatch, tmp_path):
    """A key tuned after an untuned key's nearest entry was looked up becomes that key's
    nearest entry for its next count, as the unremembered lookup says."""

    from codetta.kernels import settings

    cands = TRITON.candidates(RMS_SCALE)
    monkeypatch.setattr(tuning, "candidates", lambda call, pingpong: cands)
    monkeypatch.setattr(tuning.device, "name", lambda index: "a test GPU")
    winner = cands[3]
    times = {winner: 1.0, cands[0]: 2.0}
    monkeypatch.setattr(tuning, "tune_times", lambda key, c, prepare, measure, scout=None: times)
    chooser = tuning.Chooser()
    monkeypatch.setattr(chooser, "shipped", lambda index: {})

    def call(M):
        return _call(M, N=768)

    with settings.override(autotune=False, prefer_pingpong=False, cache_dir=tmp_path):
        assert chooser._pick(call(5000), None, False) == tuning.rule_config(call(5000), cands) != winner
        chooser.tune(call(16384), None, False, cands)
        assert chooser._pick(call(5001), None, False) == winner == chooser.untuned(call(5001), False, cands)
        assert chooser.served[chooser.key(call(5001), False)] == "nearest entry"


def test_float16_calls_take_the_bfloat16_picks(monkeypatch):
    """The shipped table holds bf16 picks alone: an fp16 call (a model held or autocast in
    fp16) takes the nearest bf16 entry of its program, not the shape rule (run 210: an fp16
    amp step 18 % slower than bf16 on the rule's configs); an fp16 entry of its own, at the
    same distance, wins."""
    import types

    from codetta.kernels import settings

    chooser = tuning.Chooser()
    cands = TRITON.candidates(RMS_SCALE) + PINGPONG.candidates(RMS_SCALE)
    call = _call(dtype=torch.float16)
    bf16 = types.SimpleNamespace(**{**vars(call), "dtype": torch.bfloat16})
    rule = tuning.rule_config(call, cands)
    pick, other = [c for c in cands if c != rule][:2]  # (neither is the rule's)
    entries = {chooser.key(bf16, True): pick}
    monkeypatch.setattr(chooser, "shipped", lambda index: entries)
    monkeypatch.setattr(chooser, "cache", lambda index: types.SimpleNamespace(entries={}))
    with settings.override(prefer_pingpong=False):
        assert chooser.untuned(call, True, cands) == pick
        entries[chooser.key(call, True)] = other
        assert chooser.untuned(call, True, cands) == other
        entries.clear()
        assert chooser.untuned(call, True, cands) == rule


def test_tune_program_filter(capsys):
    """``codetta tune --program`` lists only that program's keys, and names the programs
    a model has when asked for one it lacks."""
    from codetta.__main__ import main

    assert main(["tune", "--model", "qwen3-8b", "--tokens", "16384", "--program", "rms_qknorm_rope_128",
                 "--list"]) == 0  # fmt: skip
    keys = capsys.readouterr().out.split()
    assert len(keys) == 2 and all(k.startswith("rms_qknorm_rope_128@") for k in keys)
    assert main(["tune", "--model", "llama3-1b", "--tokens", "16384", "--program", "rms_qknorm_rope_128",
                 "--list"]) == 2  # fmt: skip
    assert "rms_rope_64" in capsys.readouterr().err


def test_tune_rope_interleaved(capsys):
    """``codetta tune --rope-interleaved`` records the q and k projections with the
    interleaved-pairs programs (and without it, the rotate-half ones); the rest of the
    step's keys are the same."""
    from codetta.__main__ import main

    args = ["tune", "--model", "llama3-8b", "--tokens", "16384", "--list"]
    assert main(args) == 0
    halves = set(capsys.readouterr().out.split())
    assert main([*args, "--rope-interleaved"]) == 0
    pairs = set(capsys.readouterr().out.split())
    assert sorted(k.partition("@")[0] for k in pairs - halves) == ["rms_rope_pairs_128"] * 2
    assert sorted(k.partition("@")[0] for k in halves - pairs) == ["rms_rope_128"] * 2


def test_tune_shorter_than(capsys):
    """``codetta tune --shorter-than US`` keeps the keys whose GEMM is estimated under US
    microseconds, and only those."""
    from codetta import tune
    from codetta.__main__ import main
    from codetta.models import KNOWN

    calls = tune.model_calls(KNOWN["llama3-1b"], (4096, 16384))
    short = sorted(k for k, c in calls.items() if tune.estimated_us(c) < 100)
    assert 0 < len(short) < len(calls)
    assert (
        main(["tune", "--model", "llama3-1b", "--tokens", "4096", "16384", "--shorter-than", "100", "--list"])
        == 0
    )
    assert capsys.readouterr().out.split() == short


def test_merge_tuned_picks(tmp_path):
    """scripts/merge_tuned.py: a tuned A/B variant's cache merged into a shipped table:
    a changed pick replaces the entry (and leaves pending), a ping-pong tail-split pick
    (tuned with CODETTA_TAIL_LAUNCH=1) is skipped unless --tail, a key of no program
    codetta has is skipped, and a cache from another GPU is refused."""
    import dataclasses

    mt = load_script("merge_tuned")
    shipped = json.loads((tuning.SHIPPED_DIR / "nvidia-h200.json").read_text())
    programs = tune.known_programs()
    key = next(
        k for k, v in sorted(shipped["entries"].items()) if k.startswith("residual_rms@") and v["pingpong"]
    )
    new_key = key.rsplit("|", 1)[0] + "|65536"  # (a key the small table lacks: pending there)
    cands = [c for c in PINGPONG.candidates(programs[key.partition("|")[0]]) if c.tail_split == 1]
    old = configs.config_from_dict(shipped["entries"][key])
    other = next(c for c in cands if c != old)
    table = {**shipped, "entries": {key: shipped["entries"][key]}, "pending": [new_key]}
    tail = dataclasses.replace(other, tail_split=configs.PINGPONG_TAIL_SPLIT)
    gone = "gone@0123456789|bfloat16|nn|1|1|1"
    ident = {"gpu": "NVIDIA H200", "triton": "3.6.1", "codetta": "0"}
    entries = {key: asdict(other), new_key: asdict(tail), gone: asdict(other)}
    cache = {"format": tuning.CACHE_FORMAT, "identity": ident, "entries": entries}
    out, changed, skipped = mt.merge(table, cache, programs)
    assert [k for k, _, _ in changed] == [key] and out["entries"][key] == asdict(other)
    assert sorted(k for k, _ in skipped) == sorted([new_key, gone])
    assert out["pending"] == [new_key] and table["entries"][key] == shipped["entries"][key]
    out, changed, _ = mt.merge(table, cache, programs, tail=True)
    assert sorted(k for k, _, _ in changed) == sorted([key, new_key]) and out["pending"] == []
    out, changed, skipped = mt.merge(table, cache, programs, only=("|65536",))
    assert not changed and [k for k, _ in skipped] == [new_key]
    with pytest.raises(ValueError, match="not format"):
        mt.merge(table, {**cache, "format": 2}, programs)
    with pytest.raises(ValueError, match="NVIDIA H100"):
        mt.merge(table, {**cache, "identity": {"gpu": "NVIDIA H100", "triton": "3.6.0"}}, programs)
    paths = tmp_path / "table.json", tmp_path / "cache.json"
    paths[0].write_text(json.dumps(table))
    paths[1].write_text(json.dumps(cache))
    assert mt.main([str(p) for p in paths]) == 0
    assert json.loads(paths[0].read_text())["entries"][key] == asdict(other)


def test_merge_tuned_from_a_log(tmp_path, capsys):
    """scripts/merge_tuned.py --from-log: a run's "codetta: tuned KEY: CONFIG" lines become
    picks (a portable one for its "|no-pingpong" twin too, a ping-pong one for its key
    alone); a log of another GPU or Triton, or a configuration no program has, is refused;
    a line of a program codetta lacks is reported as skipped; --new-only adds the keys the
    table lacks and leaves the table's own pairs as they are."""
    mt = load_script("merge_tuned")
    programs = tune.known_programs()
    ident = {"gpu": "NVIDIA H200", "triton": "3.6.0", "capability": [9, 0], "num_sms": 132}
    name = f"store@{STORE.source_key}"
    portable, pingpong = TRITON.candidates(STORE)[-1], PINGPONG.candidates(STORE)[0]
    keys = [f"{name}|bfloat16|nn|16384|2048|{k}" for k in (2048, 4096, 8192)]
    log = (
        "NVIDIA H200, 580.1, 345 MHz\ntorch 2.11.0 triton 3.6.0\n"
        f"codetta: tuning {keys[0]} over 11 configs ...\n"
        f"codetta: tuned {keys[0]}: {portable.short()} (0.2 ms; host s: ...)\n"
        f"codetta: tuned {keys[1]}: {pingpong.short()} (0.3 ms; host s: ...)\n"
        f"codetta: tuned {keys[2]}: {portable.short()} (0.4 ms; host s: ...)\n"
        "codetta: tuned gone@0123456789|bfloat16|nn|1|1|1: 128x256x64/s3w8e2g8 (0.1 ms)\n"
    )
    cache = mt.cache_from_log(log, ident, programs)
    assert cache["identity"] == ident and cache["format"] == tuning.CACHE_FORMAT
    assert cache["left_out"] == ["gone@0123456789|bfloat16|nn|1|1|1"]
    assert cache["entries"] == {
        keys[0]: asdict(portable), keys[0] + "|no-pingpong": asdict(portable),
        keys[1]: asdict(pingpong),
        keys[2]: asdict(portable), keys[2] + "|no-pingpong": asdict(portable),
    }  # fmt: skip
    with pytest.raises(ValueError, match="NVIDIA H100"):
        mt.cache_from_log(log, {**ident, "gpu": "NVIDIA H100"}, programs)
    with pytest.raises(ValueError, match="Triton 3.7"):
        mt.cache_from_log(log, {**ident, "triton": "3.7.0"}, programs)
    with pytest.raises(ValueError, match="none of its program"):
        mt.cache_from_log(log.replace(portable.short(), "512x512x64/s3w8e2g8"), ident, programs)
    other = next(c for c in TRITON.candidates(STORE) if c != portable)
    table = {"format": tuning.CACHE_FORMAT, "identity": ident, "entries": {keys[2]: asdict(other)}}
    out, changed, _ = mt.merge(table, cache, programs, new_only=True)
    assert sorted(k for k, _, _ in changed) == sorted([keys[0], keys[0] + "|no-pingpong", keys[1]])
    assert out["entries"][keys[2]] == asdict(other) and keys[2] + "|no-pingpong" not in out["entries"]
    out, changed, _ = mt.merge(table, cache, programs)
    assert out["entries"][keys[2]] == asdict(portable) and len(changed) == 5
    paths = tmp_path / "table.json", tmp_path / "log.txt"
    paths[0].write_text(json.dumps(table))
    paths[1].write_text(log)
    assert mt.main([str(paths[0]), "--from-log", str(paths[1]), "--new-only"]) == 0
    assert json.loads(paths[0].read_text())["entries"][keys[1]] == asdict(pingpong)
    said = capsys.readouterr().out  # (the line of a program codetta lacks is reported, not lost)
    assert "skipped gone@0123456789|bfloat16|nn|1|1|1: not a program" in said and "1 skipped" in said
    with pytest.raises(SystemExit):
        mt.main([str(paths[0])])  # (a cache or a log)


def test_table_ab_cache_holds_the_differing_picks(monkeypatch, shipped_triton):
    """scripts/table_ab.py: the earlier table's variant gets a tuning cache of the entries
    that differ from the shipped table's (the cache is asked first, so those keys run the
    earlier picks), and none of those it shares."""
    from codetta.kernels import device

    ab = load_script("table_ab")
    shipped = tuning.shipped_table("NVIDIA H200", (9, 0), 132)
    keys = sorted(shipped)[:3]
    other = next(c for c in configs.PINGPONG_CANDIDATES if c != shipped[keys[0]])
    before = {k: asdict(shipped[k]) for k in keys} | {keys[0]: asdict(other)}
    monkeypatch.setattr(device, "name", lambda i=0: "NVIDIA H200")
    monkeypatch.setattr(tuning.CHOOSER, "shipped", lambda i: shipped)
    folder, n = ab.before_cache(before)
    data = json.loads((folder / "tuning.json").read_text())
    assert n == 1 and list(data["entries"]) == [keys[0]] and data["entries"][keys[0]] == asdict(other)
    assert data["identity"]["gpu"] == "NVIDIA H200"


def test_retune_report(tmp_path, capsys):
    """scripts/retune_report.py: a re-tuned key's earlier pick against its new one by the
    sweep's own scores in a verbose tune log; an earlier pick missing from the sweep is
    reported as dropped by the scouting round; an unchanged key is not listed."""
    rr = load_script("retune_report")
    shipped = json.loads((tuning.SHIPPED_DIR / "nvidia-h200.json").read_text())["entries"]
    keys = sorted(k for k in shipped if not k.endswith("|no-pingpong"))[:3]
    old = {k: shipped[k] for k in keys}
    cands = list(configs.PINGPONG_CANDIDATES)
    pick = [next(c for c in cands if asdict(c) != old[k]) for k in keys]
    new = {**old, keys[0]: asdict(pick[0]), keys[1]: asdict(pick[1])}
    short = {k: configs.config_from_dict(old[k]).short() for k in keys}
    log = (f"codetta tune:  0%|  |codetta: tuning {keys[0]} over 5 configs ...\n"
           f"codetta:   {short[keys[0]]:<28} 0.0525 ms\ncodetta:   {pick[0].short():<28} 0.0500 ms\n"
           f"codetta: tuning {keys[1]} over 5 configs ...\ncodetta:   {pick[1].short():<28} 0.0300 ms\n"
           f"codetta: tuning {keys[2]} over 5 configs ...\n"
           f"codetta:   {short[keys[2]]:<28} 0.0300 ms\n")  # fmt: skip
    paths = [tmp_path / n for n in ("old.json", "new.json", "tune.txt")]
    paths[0].write_text(json.dumps({"entries": old}))
    paths[1].write_text(json.dumps({"entries": new}))
    paths[2].write_text(log)
    assert rr.main([str(p) for p in paths]) == 0
    out = capsys.readouterr().out.splitlines()
    assert len(out) == 3 and "old/new 1.050" in out[1] and "dropped by the scout" in out[0]
    assert out[-1].startswith("2 keys changed; 1 earlier picks dropped")
    assert out[-1].endswith("median old/new of the rest 1.050")


def test_every_shipped_entry_is_used():
    """Each entry of the shipped table names a program codetta has (its body's hash too)
    and a configuration among that program's candidates under the default settings: the
    chooser takes an entry only then (``Chooser.known``), so any other is silently dead
    (an edited body's old keys, a pick tuned under CODETTA_TAIL_LAUNCH=1)."""
    programs = tune.known_programs()
    for path in _tables():
        entries = json.loads(path.read_text())["entries"]
        unknown = sorted(k for k in entries if k.partition("|")[0] not in programs)
        assert not unknown, f"{path.name}: {len(unknown)} keys of no program, e.g. {unknown[:3]}"
        dead = [k for k, v in sorted(entries.items())
                if not tune.entry_usable(programs[k.partition("|")[0]], configs.config_from_dict(v),
                                         not k.endswith("|no-pingpong"))]  # fmt: skip
        assert not dead, f"{path.name}: {len(dead)} entries no default candidate matches, e.g. {dead[:3]}"


def test_tune_writes_after_every_tuned_key(monkeypatch, tmp_path):
    """``tune`` writes its table after every key it actually tunes (seconds to minutes
    each: a run cut short by its time limit keeps every key it tuned), after every 10
    others (found in the shipped table or a cache), and at the end."""
    from types import SimpleNamespace

    calls = {f"k{i}": SimpleNamespace(M=i + 1, N=1, K=1) for i in range(23)}
    tuned = {"k3", "k4", "k17"}
    monkeypatch.setattr(
        tune, "run_call", lambda call, **kw: (None, "tuned" if f"k{call.M - 1}" in tuned else "shipped")
    )
    writes = []
    monkeypatch.setattr(tune, "_write_table", lambda out, picked, old, requested: writes.append(len(picked)))
    args = SimpleNamespace(merge=False, force=False, seconds=0.1)
    assert tune._tune_all(args, calls, tmp_path / "t.json") == 0
    assert writes == [4, 5, 10, 18, 20, 23]


def test_tune_time_limit_stops_before_a_key_it_cannot_finish(monkeypatch, tmp_path, capsys):
    """``tune --time-limit S`` (gpu_call.sh passes its limit less a margin): before each key
    it estimates that key's tuning from the keys tuned so far (a fixed part plus a part per
    estimated us of GEMM time) and stops where the estimate would pass S, writes the table
    and names every key not reached (runs 276 and 280 were cut by the device call's timeout
    instead: the keys left showed only in the log's last progress line). Both kinds of
    cost: tuning that grows with the GEMM's time, and a fixed cost per key (compiles and
    the timing's seconds: a large key after small ones must not stop the run early)."""
    from types import SimpleNamespace

    clock = [0.0]
    monkeypatch.setattr(tune.time, "monotonic", lambda: clock[0])
    monkeypatch.setattr(tune, "estimated_us", lambda call: float(call.M))
    writes = []
    monkeypatch.setattr(tune, "_write_table", lambda out, picked, old, asked: writes.append(sorted(picked)))

    def run_with(sizes, seconds, limit):
        calls = {f"k{i}": SimpleNamespace(M=m, N=1, K=1) for i, m in enumerate(sizes)}

        def run(call, **kw):
            clock[0] += seconds(call.M)
            return None, "tuned"

        monkeypatch.setattr(tune, "run_call", run)
        clock[0], writes[:] = 0.0, []
        args = SimpleNamespace(merge=False, force=False, seconds=0.1, time_limit=limit)
        assert tune._tune_all(args, calls, tmp_path / "t.json", start=0.0) == 0
        return writes[-1], clock[0], capsys.readouterr().err

    # growing: 10 s per us, GEMMs of 1, 2, 4, ... us: k0-k2 take 70 s, k3 (80 s) would pass 100
    done, at, err = run_with([1, 2, 4, 8, 16, 32], lambda m: 10.0 * m, 100.0)
    assert done == ["k0", "k1", "k2"] and at == 70.0
    assert "stopped with 3 of 6 keys not reached" in err
    assert all(f"not reached: k{i}" in err for i in (3, 4, 5)) and "not reached: k2" not in err
    # fixed: 20 s a key whatever its size: all six fit in 130 s (120), the last not in 115
    done, at, err = run_with([10, 20, 30, 40, 400, 500], lambda m: 20.0, 130.0)
    assert len(done) == 6 and at == 120.0 and "not reached" not in err
    done, at, err = run_with([10, 20, 30, 40, 400, 500], lambda m: 20.0, 115.0)
    assert len(done) == 5 and "not reached: k5" in err
    # no limit: every key
    done, at, err = run_with([1, 2, 4, 8, 16, 32], lambda m: 10.0 * m, None)
    assert len(done) == 6 and "not reached" not in err


def test_tune_merge_keeps_the_pending_keys(monkeypatch, tmp_path):
    """``tune --merge`` over some models keeps the table's entries and the keys it lists as
    pending for the others (it kept the entries and listed only the run's own keys as
    pending: a shipped table refreshed that way failed the coverage test above); without
    --merge the table is the run's alone."""
    from types import SimpleNamespace

    from codetta.kernels import device

    cfg = configs.PLAIN_CANDIDATES[0]
    before = {"format": tuning.CACHE_FORMAT, "entries": {"a": asdict(cfg)}, "pending": ["b", "c"]}
    for attr, value in (("name", "GPU"), ("capability", (9, 0)), ("num_sms", 132)):
        monkeypatch.setattr(device, attr, lambda index=0, value=value: value)
    # a run asked for c, d and e, cut short before e
    calls = {k: SimpleNamespace(M=n, N=1, K=1, key=k) for n, k in enumerate(("c", "d", "e"), 1)}
    monkeypatch.setattr(tune, "run_call", lambda call, **kw: (cfg, "tuned") if call.key != "e" else 1 / 0)
    out = tmp_path / "t.json"
    for merge, entries, pending in ((True, ["a", "c", "d"], ["b", "e"]), (False, ["c", "d"], ["e"])):
        out.write_text(json.dumps(before))
        with pytest.raises(ZeroDivisionError):
            tune._tune_all(SimpleNamespace(merge=merge, force=True, seconds=0.1), calls, out)
        data = json.loads(out.read_text())
        assert sorted(data["entries"]) == entries and data["pending"] == pending


def test_tune_list_names_each_keys_source(capsys, shipped_triton):
    """``tune --list --gpu NAME`` says, for each key, whether that GPU's own table has it,
    another GPU's lends it, the program it is tuned like has a pick there, or neither; an
    unknown name lists the GPUs there are."""
    from codetta.__main__ import main

    # (Qwen3-1.7B: the H100's table has some of its keys, shared with other models, and
    # lends the rest from the H200's; Llama-3-8B's are all its own since run 284)
    args = ["tune", "--model", "qwen3-1.7b", "--tokens", "16384", "65536", "--list", "--gpu", H100[0]]
    assert main(args) == 0
    out, err = capsys.readouterr()
    rows = dict(line.split("  ", 1) for line in out.splitlines())
    own = json.loads((tuning.SHIPPED_DIR / f"{configs.gpu_slug(H100[0])}.json").read_text())["entries"]
    assert rows and all((w == "own") == (k in own) for k, w in rows.items())
    others = {w for k, w in rows.items() if k not in own}
    like = {"none, ce_logits's pick (tuned_like)", "none, ce_logits's nearest usable entry (tuned_like)"}
    assert others <= {"lent (NVIDIA H200)", "none (nearest entry or rule)"} | like
    assert "own" in err and "lent (NVIDIA H200)" in err
    # (the LM head's row-scaled logits: the H100 tuned Llama-3-8B's, run 221; where it has
    # not, as Qwen3-0.6B's (Mistral-7B's until run 269), ce_logits's entries stand in)
    assert {w for k, w in rows.items() if k.startswith("ce_logits_scaled@")} <= like | {"own"}
    assert main(["tune", "--model", "qwen3-0.6b", "--tokens", "16384", "--list", "--gpu", H100[0]]) == 0
    out, _ = capsys.readouterr()
    rows = dict(line.split("  ", 1) for line in out.splitlines())
    assert {w for k, w in rows.items() if k.startswith("ce_logits_scaled@")} <= like
    assert any(k.startswith("ce_logits_scaled@") for k in rows)
    assert main(["tune", "--model", "llama3-8b", "--list", "--gpu", "NVIDIA A1"]) == 2
    assert "NVIDIA H200" in capsys.readouterr().err


def test_tune_refuses_bad_widths_and_tokens(capsys):
    """``codetta tune --widths`` with a zero width or heads not a multiple of kv_heads, and
    ``--tokens 0``, say so (they made a traceback, or keys for 2 tokens)."""
    from codetta.__main__ import main

    for args, why in ((["--widths", "0", "0", "0", "0", "0", "0"], "every width must be >= 1"),
                      (["--widths", "64", "96", "4", "3", "16", "128"], "a multiple of kv_heads"),
                      (["--model", "llama3-1b", "--tokens", "0"], "--tokens must be >= 1")):  # fmt: skip
        assert main(["tune", *args, "--list"]) == 2
        assert why in capsys.readouterr().err
    with pytest.raises(SystemExit) as exc:  # (the model's own checks: argparse's error line)
        main(["tune", "--widths", "64", "128", "4", "2", "19", "128", "--list"])
    assert exc.value.code == 2 and "q (heads x head_dim) 76, k / v" in capsys.readouterr().err


def test_scaled_logits_take_the_plain_logits_picks(monkeypatch):
    """``ce_logits_scaled`` (the LM head's logits with the final norm's rstd) takes, at a
    shape its own entries leave untuned (here: the H200 table without them),
    ``ce_logits``'s shipped picks, not the shape rule: every one of them is its candidate
    (its whole-sub-tile ping-pong epilogue, e1, the 8B head's pick, spilled until its tile
    was stored first, ``stores_first``)."""
    import types

    from codetta.programs import CE_LOGITS, CE_LOGITS_SCALED

    assert CE_LOGITS_SCALED.tuned_like is CE_LOGITS
    data = json.loads((tuning.SHIPPED_DIR / f"{configs.gpu_slug(H200[0])}.json").read_text())
    # (its own tuned keys left out: the shapes a table has not tuned for it)
    entries = {k: configs.config_from_dict(v) for k, v in data["entries"].items()
               if not k.startswith("ce_logits_scaled@")}  # fmt: skip
    chooser = tuning.Chooser()
    monkeypatch.setattr(chooser, "shipped", lambda index: entries)
    monkeypatch.setattr(chooser, "cache", lambda index: types.SimpleNamespace(entries={}))
    cands = TRITON.candidates(CE_LOGITS_SCALED) + PINGPONG.candidates(CE_LOGITS_SCALED)
    for M, N, K in ((4096, 131072, 2048), (4096, 131072, 4096), (4096, 262144, 4096)):
        call = _call(M, N, K, program=CE_LOGITS_SCALED)
        plain = types.SimpleNamespace(**{**vars(call), "program": CE_LOGITS})
        own = entries[chooser.key(plain, True)]
        with settings.override(prefer_pingpong=False):
            got = chooser.untuned(call, True, cands)
        assert own in cands and got == own, (M, N, K)
        assert got.pingpong
