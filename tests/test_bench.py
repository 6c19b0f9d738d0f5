"""The benchmark harness's bookkeeping (the timing itself needs a GPU)."""

import re

import pytest
import torch
from util import transformers_4

from codetta.bench.harness import Results, Row, env_info, source_hash
from codetta.kernels.settings import SETTINGS, override


def test_source_hash_names_the_code():
    h = source_hash()
    assert re.fullmatch(r"[0-9a-f]{12}", h) and h == source_hash()
    assert env_info()["source"] == h


def test_table_fits_long_variant_names(tmp_path):
    res = Results("t")
    res.add(Row("1B fwd", "cublas", 1.0, 1e9, 1.0))
    res.add(Row("1B fwd", "codetta-foldgamma", 1.06, 1e9, 1.0))
    head = res.table().splitlines()[1]
    assert "cublas" in head and " codetta-foldgamma" in head  # columns do not run together
    res.write(str(tmp_path))
    assert (tmp_path / "t.json").exists() and (tmp_path / "t.csv").exists()


def test_results_load_merge_and_relabel(tmp_path):
    """A written table comes back whole (``Results.load``: paired and sustained times, the
    baseline's label); ``scripts/merge_results.py`` joins runs of one GPU and commit into
    one table (refusing other GPUs, commits or a case twice); ``scripts/relabel_results.py``
    keeps the sustained times (it once dropped them); a geomean is taken over the cases
    every variant ran."""
    from util import load_script

    def run(folder, case, variants, gpu="G", commit="abc1234"):
        res = Results("model_step", baseline="floor")
        res.env = {**res.env, "gpu": gpu, "commit": commit}
        for i, v in enumerate(variants):
            t = 1.0 + i / 10
            res.add(Row(case, v, t, 1e12, 1.0, 2.0, sustained_ms=t + 0.2, baseline_sustained_ms=1.2))
        res.write(str(tmp_path / folder))
        return str(tmp_path / folder / "model_step.json")

    a = run("a", "1B", ("floor", "eager", "codetta"))
    b = run("b", "8B", ("floor", "codetta"))  # (eager left out: out of memory)
    back = Results.load(a)
    assert back.baseline == "floor" and back.env["commit"] == "abc1234"
    assert [(r.ms, r.sustained_ms, r.baseline_sustained_ms) for r in back.rows][2] == (1.2, 1.4, 1.2)
    merge = load_script("merge_results")
    res = merge.merge([a, b])
    assert [(r.case, r.variant) for r in res.rows][-1] == ("8B", "codetta")
    table = res.table()
    # the geomeans over 1B alone, the one case all three ran (8B's codetta at 1.1 left out)
    paired = next(line for line in table.splitlines() if line.startswith("geomean (1 cases all ran)"))
    assert paired.split()[-3:] == ["1.000", "1.100", "1.200"]
    for bad, why in ((run("c", "1B", ("floor",)), "case '1B'"), (run("d", "70B", ("floor",), gpu="H"), "gpu"),
                     (run("e", "70B", ("floor",), commit="def5678"), "commit")):  # fmt: skip
        with pytest.raises(ValueError, match=why):
            merge.merge([a, bad])
    load_script("relabel_results").main(str(tmp_path / "a"), "abc1234", "fff0000")
    again = Results.load(a)
    assert again.env["commit"] == "fff0000" and [r.sustained_ms for r in again.rows] == [1.2, 1.3, 1.4]


def test_rows_keep_the_host_time(tmp_path, capsys):
    """``add_rows(host=...)``: each variant's host time per call goes to its row's JSON
    and is printed beside its time; ``host_ms`` times a call (CPU: no synchronize)."""
    import json
    import time

    from codetta.bench.harness import Timing, add_rows, host_ms

    assert 1.5 <= host_ms(lambda: time.sleep(0.002)) < 50
    res = Results("h")
    times = {"cublas": Timing(1.0, 1.1), "codetta": Timing(1.2, 2.0)}
    add_rows(res, "1B fwd+bwd", 1e9, times, host={"cublas": 0.1, "codetta": 1.9})
    assert "codetta" in capsys.readouterr().out
    res.write(str(tmp_path))
    rows = json.loads((tmp_path / "h.json").read_text())["rows"]
    assert {r["variant"]: r["extra"]["host_ms"] for r in rows} == {"cublas": 0.1, "codetta": 1.9}


def _tiny_llama():
    """(the model bench module, a tiny 1B-layers config, its float32 CPU model, token ids)."""
    pytest.importorskip("transformers")
    from codetta.bench import model as mb

    config = mb.model_config("1B-layers", hidden_size=64, intermediate_size=96, num_attention_heads=4,
                             num_key_value_heads=2, head_dim=16, max_position_embeddings=64)  # fmt: skip
    base = mb.make_model(config, device="cpu", dtype=torch.float32)
    return mb, config, base, torch.randint(0, config.vocab_size, (2, 16))


def test_check_to_eager_names_the_tensor_past_its_bound(capsys):
    """The parts' check against eager: every error returned (and printed after ``show``),
    the first tensor past the bound named in the error; forward calls run without a graph."""
    from codetta.bench.harness import check_to_eager, no_grad_call

    ref = [torch.randn(8, 4) for _ in range(2)]
    got = [ref[0] * (1 + 1e-3), ref[1] * 1.5]
    errs = check_to_eager(["a", "b"], got[:1], ref[:1], tol=1e-2, show="1B codetta")
    assert set(errs) == {"a"} and errs["a"] == pytest.approx(1e-3, rel=1e-3)
    assert "1B codetta a: relative difference to eager 1.00e-03" in capsys.readouterr().out
    with pytest.raises(AssertionError, match="^b: relative difference to eager 5.00e-01"):
        check_to_eager(["a", "b"], got, ref, tol=1e-2)
    w = torch.randn(4, requires_grad=True)
    assert not no_grad_call(torch.mul, w, 2.0)().requires_grad


def test_model_step_variants_on_cpu():
    """The model part's pieces on a tiny Llama (CPU): each variant's training step runs
    and the first-step losses agree; the floor's GEMM list covers the step."""
    mb, config, base, ids = _tiny_llama()
    losses = {}
    for name in ("eager", "codetta", "codetta:no-pingpong"):
        step = mb.variant_step(name, base, ids, ids)
        assert hasattr(step, "precompile") == name.startswith("codetta")
        if name.startswith("codetta"):
            step.precompile()  # (nothing to compile on a CPU: the wiring only)
        step()
        step()
        losses[name] = step.losses[0]
        assert SETTINGS.pingpong  # a variant's settings hold during its steps only
    assert abs(losses["codetta"] - losses["eager"]) < 1e-4 * abs(losses["eager"])
    assert losses["codetta:no-pingpong"] == losses["codetta"]  # the interpreter has one mainloop
    with pytest.raises(ValueError, match="unknown variant"):
        mb.variant_step("eager:no-pingpong", base, ids, ids)
    # forward + backward only (bench --step fwd-bwd): the weights never move, so the loss
    # after two steps is the first step's, and no optimizer state is made
    step = mb.variant_step("codetta", base, ids, ids, optimizer=False)
    step()
    step()
    assert not step.trains and step.losses[0] == pytest.approx(losses["codetta"], rel=1e-6)
    step.last_loss = step.last_loss.clone()
    mb.check_after_timing("case", {"codetta": step})
    gemms = mb.step_gemms(config, 32)
    assert len(gemms) == 7 * config.num_hidden_layers + 1 and (32, 128, 64) in gemms
    mb.floor_step(config, 2, 16, device="cpu", dtype=torch.float32)()


def test_variant_step_takes_a_sequence_length():
    """``variant_step``'s step with ``tokens`` (scripts/varlen_step.py: a new token count
    each step) trains on the first ``tokens`` of each row: its loss is the model's on
    them, not on the whole rows."""
    mb, _, base, ids = _tiny_llama()
    step = mb.variant_step("eager", base, ids, ids, optimizer=False)
    n = ids.shape[1] // 2 + 1
    step(n)
    with torch.no_grad():
        want = base(input_ids=ids[:, :n], labels=ids[:, :n], use_cache=False).loss
        whole = base(input_ids=ids, labels=ids, use_cache=False).loss
    assert step.last_loss.item() == pytest.approx(want.item(), rel=1e-6)
    assert abs(want.item() - whole.item()) > 1e-4, "the short rows' loss is the whole rows': nothing tested"
    step()
    assert step.last_loss.item() == pytest.approx(whole.item(), rel=1e-6)
    # with a padding mask (varlen_step.py's VARLEN_PAD=1, labels -100 under it) the mask is
    # cut to the same length and given to the model (padded on the left here: on the right,
    # under causal attention, a mask changes no counted token's logits)
    keep = torch.arange(ids.shape[1])[None, :] >= torch.tensor([[3], [0]])
    labels, mask = ids.masked_fill(~keep, -100), keep.long()
    step = mb.variant_step("eager", base, ids, labels, optimizer=False, attention_mask=mask)
    step(n)
    kw = dict(input_ids=ids[:, :n], labels=labels[:, :n], use_cache=False)
    with torch.no_grad():
        want, unmasked = base(**kw, attention_mask=mask[:, :n]).loss, base(**kw).loss
    assert step.last_loss.item() == pytest.approx(want.item(), rel=1e-6)
    assert abs(want.item() - unmasked.item()) > 1e-5, "the mask changes nothing here: nothing tested"


def test_model_step_amp_on_cpu():
    """``bench --amp``: float32 parameters, the forward under autocast to bfloat16; codetta
    runs its fused path there (CODETTA_AUTOCAST=cast, no fallback warning) and its
    first-step loss agrees with eager's under autocast; the parameters stay float32."""
    import warnings

    mb, _, base, ids = _tiny_llama()
    losses = {}
    for name in ("eager", "codetta"):
        step = mb.variant_step(name, base, ids, ids, amp=True)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            step()
        assert not [w for w in caught if "runs its own forward" in str(w.message)], name
        losses[name] = step.losses[0]
    assert SETTINGS.autocast == "cast"  # (the default; bench --amp asks for it by name too)
    assert abs(losses["codetta"] - losses["eager"]) < 2e-2 * abs(losses["eager"])
    assert mb.case_label("llama-3.2-1B", amp=True) == "llama-3.2-1B amp"


@pytest.mark.parametrize("case,kind", [("qwen3-8B-layers", "Qwen3"), ("qwen2.5-7B-layers", "Qwen2")])
def test_model_step_qwen_cases_on_cpu(case, kind):
    """The model part's Qwen3 and Qwen2.5 cases build their models (per-head q/k norms;
    q, k and v biases), and codetta's first training-step loss on each agrees with
    eager's (CPU, tiny widths)."""
    pytest.importorskip("transformers")
    from codetta.bench import model as mb

    config = mb.model_config(case, hidden_size=64, intermediate_size=96, num_attention_heads=4,
                             num_key_value_heads=2, head_dim=16, max_position_embeddings=64)  # fmt: skip
    assert type(config).__name__ == f"{kind}Config" and config.num_hidden_layers == 2
    base = mb.make_model(config, device="cpu", dtype=torch.float32)
    attn = base.model.layers[0].self_attn
    assert type(base).__name__ == f"{kind}ForCausalLM"
    assert hasattr(attn, "q_norm") if kind == "Qwen3" else attn.q_proj.bias is not None
    if kind == "Qwen2":  # (zeros at init: give them values)
        with torch.no_grad():
            for name, p in base.named_parameters():
                if name.endswith(".bias"):
                    p.normal_(0, 0.2)
    ids = torch.randint(0, config.vocab_size, (2, 16))
    losses = {}
    for name in ("eager", "codetta"):
        step = mb.variant_step(name, base, ids, ids)
        step()
        losses[name] = step.losses[0]
    assert abs(losses["codetta"] - losses["eager"]) < 1e-4 * abs(losses["eager"])


@pytest.mark.parametrize("qk_norm, pairs", [(False, False), (True, False), (False, True)])
def test_qkv_part_on_cpu(qk_norm, pairs):
    """The qkv part's pieces at a tiny shape (CPU, fp32): codetta's q, k, v and every
    gradient agree with the eager Hugging Face path (with ``pairs``, its interleaved-pairs
    form: the *-pairs cases), and the other convention does not; the floor's GEMMs are the
    three projections."""
    from codetta.bench import qkv

    dims = (64, 4, 2, 16, qk_norm, pairs)
    p = qkv.problem("1B", device="cpu", dtype=torch.float32, batch=2, seq=8, dims=dims)
    errs = qkv.check(p, qkv.codetta, tol=1e-4)
    assert len(errs) == 10 if qk_norm else 8
    with pytest.raises(AssertionError, match="relative difference"):
        qkv.check(p, lambda q, *leaves: qkv.codetta({**q, "pairs": not pairs}, *leaves), tol=1e-4)
    assert qkv.gemm_shapes(p) == [(16, 64, 64), (16, 32, 64), (16, 32, 64)]
    assert len(qkv.cublas_gemms(p, backward=True)()) == 9
    assert len(qkv.fwd_bwd(p, qkv.codetta)()) == len(p["leaves"])  # (the timed call: a gradient per leaf)


def test_ce_part_on_cpu():
    """The ce part's pieces at a tiny shape (CPU, fp32, ignored rows included): codetta's
    loss and gradients agree with eager's, and have the same bits on two runs."""
    from codetta.bench import ce

    p = ce.problem(40, 32, 200, device="cpu", dtype=torch.float32)
    errs = ce.check(p, ce.codetta, tol=1e-4)
    assert set(errs) == {"loss", "dx", "dw"}
    assert ce.same_bits(p)
    assert set(ce.check(p, ce.codetta_dx_f32, tol=1e-4)) == {"loss", "dx", "dw"}  # (the A/B variant)
    assert set(ce.check(p, ce.codetta_row_scale, tol=1e-4)) == {"loss", "dx", "dw"}  # (the row-scaled one)
    assert set(ce.check(p, ce.codetta_chunk_2g, tol=1e-4)) == {"loss", "dx", "dw"}  # (2 GiB chunks)
    assert set(ce.check(p, ce.codetta_probs, tol=1e-4)) == {"loss", "dx", "dw"}  # (no gradient pass)
    assert ce.same_bits(p, ce.codetta_probs)
    # every codetta variant of the part can be asked for by name (--variants)
    from codetta.__main__ import PART_VARIANTS
    from codetta.bench.model import ALL_VARIANTS

    assert set(ce.CODETTA_VARIANTS) <= set(PART_VARIANTS) | set(ALL_VARIANTS)
    assert ce.cublas_gemms(p, backward=True)()[1].shape == (200, 32)


def test_module_swap_confines_a_monkey_patch():
    """The model part swaps a peer's module-level patch in for its own steps only (Liger
    replaces names of the modeling module, which leaked into every later variant)."""
    import types

    from codetta.bench.model import ModuleSwap

    mod = types.ModuleType("fake_modeling")
    mod.rope, mod.Norm = "hf-rope", "hf-norm"
    with ModuleSwap(mod) as swap:
        mod.rope, mod.extra = "peer-rope", "peer-extra"
    assert (mod.rope, mod.Norm, hasattr(mod, "extra")) == ("hf-rope", "hf-norm", False)
    with swap.patched():
        assert (mod.rope, mod.Norm, mod.extra) == ("peer-rope", "hf-norm", "peer-extra")
    assert (mod.rope, hasattr(mod, "extra")) == ("hf-rope", False)


def test_settings_taking_turns_find_their_launches_again():
    """A/B variants enter and leave a settings override every step: the settings' id
    (what launch caches key on) is the same each time the same values are in force."""
    before = SETTINGS.generation
    with override(pingpong_policy="epilogue-bound"):
        first = SETTINGS.generation
    with override(pingpong_policy="epilogue-bound"):
        assert SETTINGS.generation == first != before
        with override(pingpong_policy="all"):
            assert SETTINGS.generation == before
    assert SETTINGS.generation == before


def test_cli_offers_every_model_variant():
    from codetta.__main__ import main
    from codetta.bench import model as mb

    for name in mb.ALL_VARIANTS:  # parses (the part itself needs a GPU: --help stops first)
        with pytest.raises(SystemExit) as exc:
            main(["bench", "--parts", "model", "--variants", name, "--help"])
        assert exc.value.code == 0
    with pytest.raises(SystemExit) as exc:
        main(["bench", "--parts", "model", "--variants", "codetta:bogus"])
    assert exc.value.code == 2


def test_tuned_ab_variants(monkeypatch):
    """bench --tuned-ab: beside "codetta", "codetta:shipped" (an empty cache of its own, no
    tuning) and "codetta:tuned" (the shipped table off, tuning on, a cache of its own), each
    in force only during its own calls; the table prints shipped / tuned per case."""
    from codetta.bench import harness

    seen = []
    fns = {"cublas": lambda: None, "codetta": lambda: seen.append((SETTINGS.cache_dir, SETTINGS.shipped,
                                                                    SETTINGS.autotune))}  # fmt: skip
    assert harness.with_ab_variants(fns) is fns  # (off unless the run asks)
    monkeypatch.setattr(harness.OPTIONS, "tuned_ab", True)
    ab = harness.with_ab_variants(fns)
    assert list(ab) == ["cublas", "codetta", "codetta:shipped", "codetta:tuned"]
    assert harness.with_ab_variants(ab) is ab
    for name in ("codetta", "codetta:shipped", "codetta:tuned"):
        ab[name]()
    user, shipped, tuned = seen
    assert shipped[1:] == (True, False) and tuned[1:] == (False, True)
    assert len({user[0], shipped[0], tuned[0]}) == 3 and not any(shipped[0].iterdir())
    assert (SETTINGS.cache_dir, SETTINGS.shipped, SETTINGS.autotune) == user
    res = Results("t")
    for variant, ms in (("cublas", 1.0), ("codetta", 1.1), ("codetta:shipped", 1.1), ("codetta:tuned", 1.05)):
        res.add(Row("1B fwd", variant, ms, 1e9, 1.0, sustained_ms=ms * 1.01, baseline_sustained_ms=1.01))
    table = res.table()
    assert "[shipped / tuned]" in table and re.search(r"1B fwd\s+1\.048\s+1\.048", table)
    assert re.search(r"largest\s+1\.048", table)
    with pytest.raises(ValueError, match="shipped, tuned or tuned-<method>"):
        harness.ab_settings("fast")
    with pytest.raises(ValueError, match="tuned-<method>"):
        harness.ab_settings("tuned-fast")
    with pytest.raises(ValueError, match=r"tuned-<method>\[\+tail\]"):
        harness.ab_settings("tuned-both+fast")
    tail = harness.ab_settings("tuned-both+tail")
    assert tail["tail_launch"] and tail["tune_method"] == "both" and tail["cache_dir"].is_dir()
    assert "tail_launch" not in harness.ab_settings("tuned-both")
    assert harness.ab_settings("tuned-both")["cache_dir"] != tail["cache_dir"]


def test_tuned_ab_per_method(monkeypatch):
    """bench --tuned-ab --tune-methods both sustained: one tuned variant per method, each
    tuning by its method into a cache of its own; the table prints shipped / each."""
    from codetta.bench import harness

    seen = []
    fns = {"cublas": lambda: None, "codetta": lambda: seen.append((SETTINGS.cache_dir, SETTINGS.tune_method))}
    monkeypatch.setattr(harness.OPTIONS, "tuned_ab", True)
    monkeypatch.setattr(harness.OPTIONS, "tune_methods", ("both", "sustained"))
    ab = harness.with_ab_variants(fns)
    assert list(ab) == [
        "cublas",
        "codetta",
        "codetta:shipped",
        "codetta:tuned-both",
        "codetta:tuned-sustained",
    ]
    assert harness.with_ab_variants(ab) is ab
    assert list(harness.selected(ab)) == list(ab)
    for name in ("codetta:tuned-both", "codetta:tuned-sustained"):
        ab[name]()
    assert [m for _, m in seen] == ["both", "sustained"] and seen[0][0] != seen[1][0]
    assert SETTINGS.tune_method == "paired"
    res = Results("t")
    for variant, ms in (("cublas", 1.0), ("codetta:shipped", 1.1), ("codetta:tuned-both", 1.0),
                        ("codetta:tuned-sustained", 1.1)):  # fmt: skip
        res.add(Row("1B fwd", variant, ms, 1e9, 1.0, sustained_ms=ms, baseline_sustained_ms=1.0))
    table = res.table()
    assert "[shipped / tuned-both]" in table and "[shipped / tuned-sustained]" in table
    assert re.search(r"largest\s+1\.100", table) and re.search(r"largest\s+1\.000", table)
    from codetta.__main__ import main

    monkeypatch.setattr("torch.cuda.is_available", lambda: True)
    assert main(["bench", "--tune-methods", "both"]) == 2  # (needs --tuned-ab)


def test_cli_tuned_ab():
    from codetta.__main__ import main

    with pytest.raises(SystemExit) as exc:
        main(["bench", "--tuned-ab", "--help"])
    assert exc.value.code == 0


def test_variant_selection(monkeypatch):
    """bench --variants: the operator tables time the cuBLAS baseline and the named variants
    only, and keep codetta (the base of its A/B variants) under --tuned-ab."""
    from codetta.__main__ import main
    from codetta.bench import harness

    fns = {"cublas": 0, "eager": 1, "torch.compile": 2, "codetta": 3, "codetta-triton": 4}
    assert harness.selected(fns) is fns
    monkeypatch.setattr(harness.OPTIONS, "variants", ("liger", "codetta-triton"))
    assert list(harness.selected(fns)) == ["cublas", "codetta-triton"]
    monkeypatch.setattr(harness.OPTIONS, "tuned_ab", True)
    ab = harness.with_ab_variants({**fns, "codetta": lambda: None})
    assert list(harness.selected(ab)) == ["cublas", "codetta", "codetta-triton", *harness.AB_VARIANTS]
    # the model step's baseline is its floor: it stays too (run 97 lost its table to a KeyError)
    assert list(harness.selected({"floor": 0, "eager": 1, "liger": 2})) == ["floor", "liger"]
    with pytest.raises(SystemExit) as exc:
        main(["bench", "--parts", "mlp", "--variants", "codetta-triton", "--help"])
    assert exc.value.code == 0


def test_cli_settle_ms():
    """bench --settle-ms: parsed (the part itself needs a GPU: --help stops first); negative refused."""
    from codetta.__main__ import main

    with pytest.raises(SystemExit) as exc:
        main(["bench", "--parts", "k1", "--settle-ms", "0", "--help"])
    assert exc.value.code == 0
    with pytest.raises(SystemExit) as exc:
        main(["bench", "--settle-ms", "soon"])
    assert exc.value.code == 2


def test_model_part_batch(monkeypatch, capsys):
    """bench --batch: the model part's sequences per step; rows at another batch than the
    default name their tokens (a 4096-token row never reads as the 16384-token case), and a
    batch below one is refused before any model is built."""
    from codetta.__main__ import main
    from codetta.bench import model as mb

    assert mb.case_label("llama-3.2-1B") == "llama-3.2-1B"
    assert mb.case_label("llama-3.2-1B", batch=1) == "llama-3.2-1B @4096"
    assert mb.case_label("1B-layers", "fwd-bwd", batch=2) == "1B-layers @8192 fwd+bwd"
    assert mb.case_label("1B-layers", "fwd-bwd") == "1B-layers fwd+bwd"
    with pytest.raises(ValueError, match="batch must be >= 1"):
        mb.run_case(Results("t"), "1B-layers", batch=0)
    monkeypatch.setattr("torch.cuda.is_available", lambda: True)
    assert main(["bench", "--parts", "model", "--batch", "0"]) == 2
    assert "--batch must be >= 1" in capsys.readouterr().err


def test_compare_leaves_stateful_steps_alone(monkeypatch):
    """The model part times training steps: compare(precompile=False) must not dry-run them
    (a dry run skips codetta's kernels, so an optimizer step in it trains on garbage)."""
    from codetta.bench import harness

    dry = []
    monkeypatch.setattr(harness, "precompile_variants", lambda fns: dry.append(sorted(fns)))
    monkeypatch.setattr(harness.torch.cuda, "synchronize", lambda: None)
    monkeypatch.setattr(harness, "paired_ms", lambda fns: dict.fromkeys(fns, 1.0))
    monkeypatch.setattr(harness, "sustained_ms", lambda fns, **kw: dict.fromkeys(fns, 1.0))
    calls = []
    fns = {"floor": lambda: calls.append("floor"), "codetta": lambda: calls.append("codetta")}
    harness.compare(fns, precompile=False)
    assert dry == [] and sorted(calls) == ["codetta", "floor"]
    harness.compare(fns)
    assert dry == [["codetta", "floor"]]


def test_compare_rounds(monkeypatch):
    """--rounds N: the whole timing N times, each method's median reported, every round kept;
    round_spread gives the ratio's range over the rounds."""
    from codetta.__main__ import main
    from codetta.bench import harness

    monkeypatch.setattr(harness.torch.cuda, "synchronize", lambda: None)
    times = iter([1.0, 3.0, 2.0, 9.0, 5.0, 4.0])  # per round: paired then sustained
    base = iter([1.0, 1.0, 1.0, 2.0, 2.0, 2.0])

    def fake(fns, **kw):
        return {"floor": next(base), "codetta": next(times)}

    monkeypatch.setattr(harness, "paired_ms", fake)
    monkeypatch.setattr(harness, "sustained_ms", fake)
    monkeypatch.setattr(harness.OPTIONS, "rounds", 3)
    t = harness.compare({"floor": lambda: None, "codetta": lambda: None}, precompile=False)
    assert t["codetta"].rounds == [(1.0, 3.0), (2.0, 9.0), (5.0, 4.0)]
    assert (t["codetta"].paired, t["codetta"].sustained) == (2.0, 4.0)  # the medians
    # floor's rounds (1, 1), (1, 2), (2, 2): ratios 1, 2, 2.5 paired and 3, 4.5, 2 sustained
    spread = harness.round_spread(t["codetta"], t["floor"])
    assert spread == "rounds: paired 1.000-2.500, sustained 2.000-4.500"
    assert harness.round_extra(t["codetta"]) == {"rounds_ms": [[1.0, 3.0], [2.0, 9.0], [5.0, 4.0]]}
    monkeypatch.setattr(harness.OPTIONS, "rounds", 1)
    times, base = iter([1.0, 2.0]), iter([1.0, 1.0])
    one = harness.compare({"floor": lambda: None, "codetta": lambda: None}, precompile=False)
    assert one["codetta"].rounds == [] and harness.round_spread(one["codetta"], one["floor"]) == ""
    monkeypatch.setattr("torch.cuda.is_available", lambda: True)
    assert main(["bench", "--parts", "k1", "--rounds", "0"]) == 2


def test_model_part_refuses_steps_that_broke_their_weights():
    """After the timing each step's loss must be finite and below its first step's."""
    import torch

    from codetta.bench import model

    def step(first, last):
        def fn():
            pass

        fn.losses, fn.last_loss = [first], torch.tensor(last)
        return fn

    model.check_after_timing("case", {"floor": lambda: None, "codetta": step(12.16, 12.15)})
    model.check_after_timing("case", {"eager": step(12.16, 8.44)})  # (run 103: one batch, trained)
    for bad in (float("nan"), float("inf"), 12.17, 13.0):
        with pytest.raises(AssertionError, match="codetta's loss went from 12.16"):
            model.check_after_timing("case", {"liger": step(12.16, 11.0), "codetta": step(12.16, bad)})
    # forward + backward only (no optimizer): the loss must stay the first step's
    still = step(12.16, 12.16)
    still.trains = False
    model.check_after_timing("case", {"codetta": still})
    for bad in (float("nan"), 12.0, 12.2):
        moved = step(12.16, bad)
        moved.trains = False
        with pytest.raises(AssertionError, match="weights unchanged"):
            model.check_after_timing("case", {"codetta": moved})


def test_model_part_leaves_out_a_variant_that_runs_out_of_memory(capsys):
    """A variant whose step runs out of GPU memory (every variant's model and AdamW state
    share one process: on an H100 the 1B step's eager variant did not fit beside three
    others, runs 262 and 265) leaves the run with the reason; the others are measured; the
    floor's own out-of-memory error is raised (the table's baseline)."""
    import weakref

    from codetta.bench import model

    class Step:
        def __init__(self, oom):
            self.oom, self.weights = oom, torch.randn(64)

        def __call__(self):
            if self.oom:
                raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 7.83 GiB")
            return 1.5

    fns = {"floor": Step(False), "eager": Step(True), "codetta": Step(False)}
    gone = weakref.ref(fns["eager"])
    mem = {k: model.run_or_leave_out(fns, k, "case", fns[k]) for k in list(fns)}
    assert list(fns) == ["floor", "codetta"] and mem == {"floor": 1.5, "eager": None, "codetta": 1.5}
    assert gone() is None  # (its model freed, not held by the error's frames)
    err = capsys.readouterr().err
    assert "case: eager left out: CUDA out of memory with 3 variants" in err and "--variants" in err
    fns = {"floor": Step(True)}
    with pytest.raises(torch.OutOfMemoryError):
        model.run_or_leave_out(fns, "floor", "case", fns["floor"])
    assert "floor" in fns


def test_model_ab_steps_own_their_models(monkeypatch):
    """bench --tuned-ab, model part: each A/B variant is a step built for it (a model and
    optimizer of its own) under its settings, and runs once before the timing."""
    from codetta.bench import harness, model

    built, ran = [], []

    def build(changes):
        built.append(changes)
        return lambda: ran.append(len(built))

    fns = {"floor": None, "codetta": None}
    assert model.add_ab_steps(dict(fns), build) == fns and not built  # (off unless asked)
    monkeypatch.setattr(harness.OPTIONS, "tuned_ab", True)
    monkeypatch.setattr(harness.OPTIONS, "tune_methods", ("both", "both+tail"))
    out = model.add_ab_steps(dict(fns), build)
    assert list(out) == [
        "floor",
        "codetta",
        "codetta:shipped",
        "codetta:tuned-both",
        "codetta:tuned-both+tail",
    ]
    assert len({id(out[k]) for k in list(out)[2:]}) == 3 and ran == [1, 2, 3]
    assert built[0]["autotune"] is False and "tail_launch" not in built[1]
    assert built[2]["tail_launch"] and built[2]["tune_method"] == "both"
    assert harness.with_ab_variants(out) is out  # (compare adds no shared-model variants)
    assert model.add_ab_steps({"floor": None, "liger": None}, build) == {"floor": None, "liger": None}


def test_ab_caches_come_back(tmp_path):
    """bench --tuned-ab: each tuned A/B variant's cache is copied beside the results
    (``<out>/ab-tuned/<variant>.json``), the shipped variant's (empty) one not."""
    from codetta.bench import harness

    tuned = harness.ab_settings("tuned-both+tail")["cache_dir"]
    harness.ab_settings("shipped")
    (tuned / "tuning.json").write_text('{"format": 3}')
    written = harness.save_ab_caches(tmp_path)
    assert tmp_path / "ab-tuned" / "tuned-both+tail.json" in written
    assert (tmp_path / "ab-tuned" / "tuned-both+tail.json").read_text() == '{"format": 3}'
    assert not (tmp_path / "ab-tuned" / "shipped.json").exists()


def test_ab_caches_come_back_from_a_run_cut_short(tmp_path, monkeypatch):
    """bench --tuned-ab cut by `timeout` (SIGTERM) in the middle of a part: the picks that
    part had tuned still come back, and the signal's handler is put back afterwards."""
    import os
    import signal

    from codetta.__main__ import main
    from codetta.bench import foundation, harness

    def cut_short(out, parts):
        cache = harness.ab_settings("tuned")["cache_dir"] / "tuning.json"
        cache.write_text('{"format": 3, "picked": "' + parts[0] + '"}')
        os.kill(os.getpid(), signal.SIGTERM)
        raise AssertionError("SIGTERM did not stop the part")

    monkeypatch.setattr("torch.cuda.is_available", lambda: True)
    monkeypatch.setattr(foundation, "run", cut_short)
    monkeypatch.setattr(harness, "OPTIONS", harness.Options())
    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(SystemExit) as exc:
        main(["bench", "--tuned-ab", "--parts", "plain", "backward", "--out", str(tmp_path)])
    assert exc.value.code == 128 + signal.SIGTERM
    assert signal.getsignal(signal.SIGTERM) is before
    saved = tmp_path / "ab-tuned" / "tuned.json"
    assert saved.read_text() == '{"format": 3, "picked": "plain"}'


def test_ce_cases_reach_the_part_in_the_order_given(monkeypatch, tmp_path):
    """`--ce-cases` names cases as TOKENSxDxV: the ce part gets exactly those shapes, in
    the order given, and a name that is no case is refused by the parser."""
    from codetta.__main__ import main
    from codetta.bench import ce, harness

    got = []
    monkeypatch.setattr("torch.cuda.is_available", lambda: True)
    monkeypatch.setattr(ce, "run", lambda out, cases: got.append(cases))
    monkeypatch.setattr(harness, "OPTIONS", harness.Options())
    argv = ["bench", "--parts", "ce", "--out", str(tmp_path), "--ce-cases"]
    assert main([*argv, "16384x4096x262144", "8192x2048x128256"]) == 0
    assert got == [((16384, 4096, 262144), (8192, 2048, 128256))]
    got.clear()
    assert main(argv[:-1]) == 0  # (every case by default)
    assert got == [tuple(ce.CASES)] and len(ce.CASES) == 5
    with pytest.raises(SystemExit):
        main([*argv, "16384x4096x1000"])
    # (the GPU scripts' case names too: a bad one would cost a device call)
    import pathlib
    import re

    from codetta.__main__ import CE_CASES_BY_NAME

    script = (pathlib.Path(__file__).parents[1] / "scripts" / "pending_gpu.sh").read_text()
    named = [n for m in re.findall(r"--ce-cases ([0-9x ]+)", script) for n in m.split()]
    assert named and set(named) <= set(CE_CASES_BY_NAME)


def test_regional_compile_variant_keeps_the_causal_path(monkeypatch):
    """torch.compile:regional compiles each decoder layer and the loss, not the whole
    model: its step matches eager's, and the layers get no materialized mask (Hugging
    Face's is_causal path for SDPA, which a whole-model compile on torch < 2.14 loses)."""
    pytest.importorskip("transformers")
    import functools

    from codetta.bench import model as mb

    # (the wiring, not inductor's code generation: the CPU suite stays fast)
    monkeypatch.setattr(torch, "compile", functools.partial(torch.compile, backend="aot_eager"))
    config = mb.model_config("1B-layers", hidden_size=64, intermediate_size=96, num_attention_heads=4,
                             num_key_value_heads=2, head_dim=16, max_position_embeddings=64)  # fmt: skip
    base = mb.make_model(config, device="cpu", dtype=torch.float32)
    ids = torch.randint(0, config.vocab_size, (2, 16))
    eager = mb.variant_step("eager", base, ids, ids)
    eager()
    step = mb.variant_step("torch.compile:regional", base, ids, ids)
    from transformers.models.llama import modeling_llama

    masks = []
    real = modeling_llama.LlamaDecoderLayer.forward

    def spy(self, *args, **kwargs):
        masks.append(kwargs.get("attention_mask"))
        return real(self, *args, **kwargs)

    monkeypatch.setattr(modeling_llama.LlamaDecoderLayer, "forward", spy)
    step()
    step()
    assert abs(step.losses[0] - eager.losses[0]) < 1e-4 * abs(eager.losses[0])
    kinds = {type(m) for m in masks}
    if not transformers_4():
        assert masks and kinds == {type(None)}, kinds
    else:  # (4.53-4.57 build a mask from the position ids, their packed-sequence check, in eager too)
        masks.clear()
        mb.variant_step("eager", base, ids, ids)()
        assert masks and {type(m) for m in masks} == kinds
    both = mb.variant_step("codetta+compile:regional", base, ids, ids)
    both()
    assert abs(both.losses[0] - eager.losses[0]) < 1e-4 * abs(eager.losses[0])
    with pytest.raises(ValueError, match="unknown variant"):
        mb.variant_step("eager:regional", base, ids, ids)


def test_launch_census_on_cpu(capsys):
    """scripts/launch_census.py: the drop-in's step counted on the CPU: its GEMMs by program
    (every projection's forward, dX and dW, the loss's logits), its row passes, and the
    PyTorch operators around them (none counted twice: the interpreter's own operators
    inside a kernel are left out). CPU machines only: on a GPU machine the interpreter is
    off and a CPU model's operators run their PyTorch references, launching no kernel to
    count (run 202)."""
    pytest.importorskip("transformers")
    from conftest import ON_GPU
    from util import load_script

    from codetta.bench import model as mb

    if ON_GPU:
        pytest.skip("counts the interpreter's kernel launches (CPU machines)")
    lc = load_script("launch_census")

    config = mb.model_config("1B-layers", hidden_size=64, intermediate_size=128, num_attention_heads=4,
                             num_key_value_heads=2, head_dim=16, max_position_embeddings=16,
                             num_hidden_layers=1)  # fmt: skip
    base = mb.make_model(config, device="cpu", dtype=torch.float16)
    ids = torch.randint(0, config.vocab_size, (1, 16))
    counts = {}
    for name in ("eager", "codetta"):
        step = mb.variant_step(name, base, ids, ids, optimizer=False)
        step()
        counts[name] = lc.census(step)
    c = counts["codetta"]
    # a layer: q/k/v, o, gate/up, down forward; their dX and dW; the loss's logits GEMM
    # (float16: on the final norm's n, formed by a pass; bf16 hands h and rstd to the loss)
    assert c["gemm"]["ce_logits"] == 1 and sum(c["gemm"].values()) >= 7 * 3 - 2
    assert sum(c["rows"].values()) > 0 and "set_" not in c["aten"] and "mm" not in c["aten"]
    assert counts["eager"]["aten"]["mm"] > 0 and not counts["eager"]["gemm"]


def test_profile_step_times_every_gemm_call(monkeypatch):
    """scripts/profile_step.py's call timer wraps every operator module's ``gemm``, the
    norm backward's among them (until run 264 it missed those: the dX and dW of q/k/v and
    gate/up, ~60 ms of the 8B slice's GEMM time untimed): on the CPU's tiny Llama layer
    (CUDA events stubbed) it sees each projection's forward, dX and dW call, and the bytes
    each moves at the least."""
    pytest.importorskip("transformers")
    from conftest import ON_GPU
    from util import load_script

    from codetta.bench import model as mb
    from codetta.kernels import launch

    if ON_GPU:
        pytest.skip("the interpreter's launches (CPU machines)")
    ps = load_script("profile_step")
    assert {m.__name__.rpartition(".")[2] for m in ps._OPS} >= {"norm_backward", "residual_rmsnorm", "swiglu"}

    class Event:
        def __init__(self, **kw):
            pass

        def record(self):
            pass

    monkeypatch.setattr(torch.cuda, "Event", Event)
    config = mb.model_config("1B-layers", hidden_size=64, intermediate_size=128, num_attention_heads=4,
                             num_key_value_heads=2, head_dim=16, max_position_embeddings=16,
                             num_hidden_layers=1)  # fmt: skip
    base = mb.make_model(config, device="cpu", dtype=torch.float16)
    ids = torch.randint(0, config.vocab_size, (1, 16))
    step = mb.variant_step("codetta", base, ids, ids, optimizer=False)
    step()  # (first: any one-time work outside the count)
    with ps.CallTimer() as timer:
        step()
    assert all(m.gemm is launch.gemm for m in ps._OPS)  # (unwrapped again)
    programs = [key[0] for key, _, _ in timer.marks]
    # a layer: q/k/v, o, gate/up, down forward, their dX and dW (some in one launch), the
    # loss's logits; the norm backward's dW of a norm-scaled input is a plain store
    assert len(programs) >= 7 * 3 - 2 and "ce_logits" in programs
    assert sum(p.startswith("store") for p in programs) >= 4
    # each call's least HBM bytes: dSwiGLU (16 tokens, f 128, d 64, fp16) reads dy and the
    # down weight once, g and u, and writes their gradients
    (dswiglu,) = [b for key, b in timer.bytes.items() if key[0] == "dswiglu"]
    assert dswiglu == 2 * (16 * 64 + 128 * 64 + 4 * 16 * 128)


def test_no_script_switches_the_interpreter_on_when_imported():
    """A script may switch Triton's interpreter on for its own run, never at import: the
    tests load scripts as modules (``load_script``), and an environment variable set then
    stays for the rest of the process, so a GPU test process later ran torch.compile's own
    kernels through the interpreter (run 250). Checked on each script's top-level
    statements (an assignment inside ``if __name__ == "__main__":`` is the program's)."""
    import ast
    from pathlib import Path

    scripts = sorted((Path(__file__).resolve().parents[1] / "scripts").glob("*.py"))
    assert scripts
    leaks = []
    for path in scripts:
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                continue  # (runs when called, not at import)
            if isinstance(node, ast.If) and "__main__" in ast.unparse(node.test):
                continue
            src = ast.unparse(node)
            sets = "setdefault" in src or "] =" in src or ".update(" in src
            if "TRITON_INTERPRET" in src and "environ" in src and sets:
                leaks.append(f"{path.name}:{node.lineno}")
    assert not leaks, f"scripts that set TRITON_INTERPRET when imported: {leaks}"
