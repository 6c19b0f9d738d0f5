"""codetta under torch.distributed, on CPU: ``python -m codetta train`` launched with
torchrun (2 processes, gloo, fp32, the operators' PyTorch reference path). A patched
tiny model trained under FSDP2 and under DDP, with gradient accumulation, ends with
the same weights and losses as one process training the same patched model on the
same global batches. The GPU run (NCCL, bf16, 2 H200s) is scripts/fsdp_run.sh."""

import argparse
import contextlib
import json
import os
import subprocess
import sys
import warnings

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("torch.distributed.fsdp")

TOL = 1e-5  # fp32 after 4 AdamW steps: only the order of the gradient sums differs
COMMON = ["--seq-len", "16", "--batch", "4", "--steps", "4", "--warmup", "1", "--lr", "1e-3",
          "--dtype", "fp32", "--device", "cpu"]  # fmt: skip


def _config(tmp_path, family):
    common = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=64,
                  rms_norm_eps=1e-5)  # fmt: skip
    if family == "llama":
        cfg = transformers.LlamaConfig(tie_word_embeddings=True, **common)
    elif family == "qwen2":  # (q, k and v biases; zeros at init, trained from the first step)
        cfg = transformers.Qwen2Config(tie_word_embeddings=True, **common)
    elif family == "phi3":  # (fused qkv_proj and gate_up_proj; its default special ids are past V)
        cfg = transformers.Phi3Config(tie_word_embeddings=False, pad_token_id=None, bos_token_id=None,
                                      eos_token_id=None, **common)  # fmt: skip
    else:
        cfg = transformers.Qwen3Config(tie_word_embeddings=False, **common)
    folder = tmp_path / family
    cfg.save_pretrained(folder)
    return folder / "config.json"


def _train(tmp_path, config, tag, nproc, *args):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # the reference path
    env["PYTHONPATH"] = os.pathsep.join(
        [os.path.dirname(os.path.dirname(__file__)), env.get("PYTHONPATH", "")]
    )
    out, save = tmp_path / f"{tag}.json", tmp_path / f"{tag}.pt"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
           "-m", "codetta", "train", "--model", str(config), *COMMON, "--out", str(out),
           "--save", str(save), *args]  # fmt: skip
    run = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-5000:]
    return json.loads(out.read_text()), torch.load(save)


def _train_in_process(tmp_path, config, tag, *extra):
    """One process, in this one (a launch of its own cost ~10 s of the suite's time):
    (the run's JSON summary, the trained weights)."""
    from codetta.train import add_arguments, train

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    out, save = tmp_path / f"{tag}.json", tmp_path / f"{tag}.pt"
    train(parser.parse_args(["--model", str(config), *COMMON, "--parallel", "none", "--out", str(out),
                             "--save", str(save), *extra]))  # fmt: skip
    return json.loads(out.read_text()), torch.load(save)


def _train_here(tmp_path, config, tag):
    """The patched model in one process: the operators' PyTorch reference path, as in
    the launched processes (which run without the interpreter)."""
    from codetta.kernels.settings import override

    with override(force_reference=True):
        run = _train_in_process(tmp_path, config, tag, "--time-from", "1", "--host-profile", "2",
                                "--precompile")  # fmt: skip
    # --host-profile: where the host's time went over steps 1-2, by function
    host = (tmp_path / f"{tag}.host.txt").read_text()
    assert "2 steps by tottime" in host and "2 steps by cumulative" in host and "launch.py" in host
    return run


def _rel(a, b):
    return max(((a[k] - b[k]).abs().max() / b[k].abs().max()).item() for k in b)


@pytest.mark.parametrize("family", ["llama", "qwen3", "qwen2", "phi3"])
def test_fsdp2_and_ddp_match_one_process(tmp_path, family):
    """llama: tied embeddings, FSDP2 and DDP; qwen3: per-head q/k norms in the boundary
    operator's epilogue (the next layer's parameters), FSDP2 with the base model wrapped
    too (its embeddings and final norm gathered for the whole forward; FSDP2 itself
    refuses that with tied embeddings) and Hugging Face's gradient checkpointing; qwen2:
    the next layer's q, k and v biases in that epilogue too, FSDP2 with checkpointing; phi3:
    the fused projections read as row blocks of FSDP2's gathered weights, with checkpointing. All with 2
    micro-batches per step (gradients synchronised after the second only)."""
    config = _config(tmp_path, family)
    one, w_one = _train_here(tmp_path, config, "one")
    from codetta.train import hf_config

    torch.manual_seed(0)  # the weights every run starts from (train's --seed 0)
    init = transformers.AutoModelForCausalLM.from_config(hf_config(str(config), None, None, 16))
    w_init = {k: v.float() for k, v in init.state_dict().items()}
    # the host's time to issue a step is part of the step's time (it ends in a synchronization)
    assert len(one["host_ms"]) == len(one["step_ms"])
    assert all(0 < h <= s for h, s in zip(one["host_ms"], one["step_ms"]))
    moved = _rel(w_one, w_init)
    assert moved > 1000 * TOL, f"training moved the weights by only {moved:.2e}: the test could not fail"
    # (qwen3's one run covers both its own point and the outer span: a suite-time budget)
    # (qwen3's run also checkpoints: Hugging Face's gradient checkpointing under FSDP2)
    runs = {
        "llama": [("fsdp",), ("ddp",)],
        "qwen2": [("fsdp", "--grad-checkpointing")],
        "phi3": [("fsdp", "--grad-checkpointing")],
    }.get(family, [("fsdp", "--wrap-base", "--grad-checkpointing")])
    for parallel, *extra in runs:
        tag = parallel + "".join(extra)
        res, w = _train(tmp_path, config, tag, 2, "--parallel", parallel, "--accum", "2", *extra)
        assert res["world"] == 2 and res["codetta"]
        assert sorted(w) == sorted(w_one)
        # Qwen2's k biases: their gradient is near zero (softmax ignores a shift common to a
        # query's keys; only RoPE's turn of the bias is left), so the order of the gradient
        # sums moves it relatively far and AdamW's normalized step carries that to the weight:
        # 1e-4 to 6e-4 apart for the unpatched model too (FSDP2 against one process, NOTES.md)
        k_bias = [k for k in w_one if k.endswith("k_proj.bias")]
        err = _rel(
            {k: w[k] for k in w if k not in k_bias}, {k: v for k, v in w_one.items() if k not in k_bias}
        )
        if family == "phi3" or err >= TOL:
            # (one weight of this tiny model, layer 0's down_proj, moves 1.2e-5 under FSDP2 for
            # the unpatched model too: its own spread, per weight, bounds codetta's; so for
            # Qwen3 (layer 2's gate_proj: the unpatched model 1.9e-5, codetta 1.1e-5) and
            # Qwen2 after the split log-sum-exp, NOTES.md; measured only where TOL is passed)
            p_one = _train_in_process(tmp_path, config, "plain-one", "--no-codetta")[1]
            _, p_w = _train(tmp_path, config, "plain-" + tag, 2, "--parallel", parallel, "--accum", "2",
                            "--no-codetta", *extra)  # fmt: skip
            for k in w_one:
                spread = _rel({k: p_w[k]}, {k: p_one[k]})
                got = _rel({k: w[k]}, {k: w_one[k]})
                assert got <= max(TOL, 2 * spread), (
                    f"{tag}: {k} {got:.2e} from one process's (unpatched {spread:.2e})"
                )
        else:
            assert err < TOL, f"{tag}: weights differ from one process's by {err:.2e}"
        if k_bias:
            err = _rel({k: w[k] for k in k_bias}, {k: w_one[k] for k in k_bias})
            assert err < 2e-3, f"{tag}: k biases differ from one process's by {err:.2e}"
        assert res["losses"] == pytest.approx(one["losses"], rel=TOL)


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_train_amp(tmp_path, dtype, monkeypatch):
    """``codetta train --amp``: float32 parameters, each forward under autocast to --dtype
    (fp16 with a GradScaler), codetta in its cast mode, from a config that names bf16: the
    fused path runs (no fallback warning; with --precompile), the trained weights are
    float32, and the losses follow the unpatched model's under the same autocast (to
    bf16/fp16 rounding: the runs differ only there); bf16 under DDP on two processes gives
    one process's losses. --amp with fp32 or FSDP2 is refused with the reason."""
    import warnings

    from codetta.kernels.settings import override
    from codetta.train import add_arguments, train

    config = _config(tmp_path, "llama")
    # a config naming bf16 (as the hub's do): from_config builds in it; --amp must not train there
    cfg = json.loads(config.read_text())
    config.write_text(json.dumps({**cfg, "dtype": "bfloat16", "torch_dtype": "bfloat16"}))
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    plain = ["--model", str(config), *COMMON[:-4], "--device", "cpu", "--parallel", "none"]
    common = [*plain, "--dtype", dtype, "--amp"]
    scaled = []  # (fp16: every step through the GradScaler)
    step = torch.amp.GradScaler.step
    monkeypatch.setattr(torch.amp.GradScaler, "step", lambda self, opt: scaled.append(1) or step(self, opt))
    res, weights = {}, {}
    for tag in ("codetta", "no-codetta", "float32"):
        argv = [*plain, "--dtype", "fp32", "--no-codetta"] if tag == "float32" else [*common, f"--{tag}"]
        argv += ["--precompile"] if tag == "codetta" else []
        out, save = tmp_path / f"{tag}.json", tmp_path / f"{tag}.pt"
        args = parser.parse_args([*argv, "--out", str(out), "--save", str(save)])
        from codetta.integrations import hf

        hf._FALLBACK_WARNED.clear()  # (it warns once per reason and process)
        with override(force_reference=True), warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            train(args)
        assert not [w for w in caught if "runs its own forward" in str(w.message)], tag
        res[tag], weights[tag] = json.loads(out.read_text()), torch.load(save)
    assert res["codetta"]["amp"] and res["codetta"]["codetta"] and not res["no-codetta"]["codetta"]
    assert len(scaled) == (2 * len(res["codetta"]["losses"]) if dtype == "fp16" else 0)
    assert res["codetta"]["param_dtype"] == res["no-codetta"]["param_dtype"] == "float32"
    ours, base = res["codetta"]["losses"], res["no-codetta"]["losses"]
    assert base[-1] < base[0], "training did not lower the loss: the comparison says little"
    assert ours == pytest.approx(base, rel=2e-2)
    # (and both computed in --dtype: float32 training's losses differ by more than its own
    # noise: fp16's 2.2e-5 to 5.4e-5 at most over the steps, transformers 4.53 and 5.25;
    # float32 with and without codetta 5e-7)
    exact = res["float32"]["losses"]
    assert min(max(abs(a - b) for a, b in zip(run, exact)) for run in (ours, base)) > 1e-5
    if dtype == "bf16":  # DDP on two processes: the same losses as one process, to bf16 rounding
        ddp, _ = _train(tmp_path, config, "ddp-amp", 2, "--parallel", "ddp", "--dtype", dtype, "--amp")
        assert ddp["world"] == 2 and ddp["amp"] and ddp["losses"] == pytest.approx(ours, rel=2e-3)
    for bad, why in ((["--dtype", "fp32"], "bf16 or fp16"), (["--parallel", "fsdp"], "MixedPrecisionPolicy")):
        with pytest.raises(SystemExit, match=why):
            train(parser.parse_args([*common, *bad]))


def test_train_fp16_skipped_steps_leave_the_schedule(tmp_path, monkeypatch):
    """``codetta train --amp --dtype fp16``: a step the GradScaler skips (a gradient
    overflowed: its scale shrinks) does not advance the learning-rate schedule, as Trainer
    does, read after the step with no host wait mid-step; the other steps do. A loss scale
    started at 2^40 overflows the first steps' fp16 gradients."""
    from codetta.train import add_arguments, train

    config = _config(tmp_path, "llama")
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    init = torch.amp.GradScaler.__init__
    monkeypatch.setattr(
        torch.amp.GradScaler, "__init__", lambda self, *a, **k: init(self, *a, init_scale=2.0**40)
    )
    scales, stepped = [], []
    update = torch.amp.GradScaler.update
    monkeypatch.setattr(
        torch.amp.GradScaler, "update", lambda self, *a: update(self, *a) or scales.append(self.get_scale())
    )
    sched_step = torch.optim.lr_scheduler.LambdaLR.step
    monkeypatch.setattr(
        torch.optim.lr_scheduler.LambdaLR, "step", lambda self, *a: stepped.append(1) or sched_step(self, *a)
    )
    argv = ["--model", str(config), *COMMON[:-4], "--steps", "40", "--device", "cpu", "--parallel", "none",
            "--dtype", "fp16", "--amp", "--no-codetta", "--out", str(tmp_path / "out.json")]  # fmt: skip
    train(parser.parse_args(argv))
    taken = [b >= a for a, b in zip([2.0**40, *scales], scales)]
    assert len(taken) == 40 and 0 < sum(taken) < 40, scales  # (some steps skipped, some taken)
    assert len(stepped) == 1 + sum(taken)  # (LambdaLR steps once as it is made)


def test_token_streams(tmp_path):
    """train's data: a token file gives sequence g = tokens[g*T:(g+1)*T] (wrapping around);
    the synthetic stream follows its rule (each token is followed by the next or the one
    after in a fixed order of 64 tokens) and depends only on the sequence's index."""
    from codetta.train import Stream

    tokens = torch.randint(0, 1000, (10 * 8 + 3,), dtype=torch.int32)
    path = tmp_path / "tokens.bin"
    path.write_bytes(tokens.numpy().tobytes())
    file = Stream(str(path), "int32", 8, 1000, 0)
    got = file.sequences(3, 9)
    assert got.dtype == torch.int64 and got.shape == (9, 8)
    assert torch.equal(got[0], tokens[24:32].long()) and torch.equal(got[7], tokens[0:8].long())  # 10 % 10
    with pytest.raises(SystemExit, match="outside the vocabulary"):
        Stream(str(path), "int32", 8, 500, 0)
    # uint16, the default (no max on the CPU: read a chunk at a time), and negative ids
    small = tmp_path / "u16.bin"
    small.write_bytes(tokens.to(torch.int16).numpy().tobytes())
    assert torch.equal(Stream(str(small), "uint16", 8, 1000, 0).sequences(0, 1)[0], tokens[:8].long())
    (tmp_path / "neg.bin").write_bytes(
        torch.cat([tokens, torch.tensor([-3], dtype=torch.int32)]).numpy().tobytes()
    )
    with pytest.raises(SystemExit, match="token id -"):
        Stream(str(tmp_path / "neg.bin"), "int32", 8, 1000, 0)
    for bad, why in ((str(tmp_path / "none.bin"), "no such file"), (str(tmp_path), "no such file")):
        with pytest.raises(SystemExit, match=why):
            Stream(bad, "int32", 8, 1000, 0)
    synth = Stream("synthetic", "int32", 256, 32000, 0)
    seqs = synth.sequences(5, 4)
    assert torch.equal(seqs[1:], synth.sequences(6, 3))
    where = {int(t): i for i, t in enumerate(synth.used)}
    steps = torch.tensor([[where[int(b)] - where[int(a)] for a, b in zip(s[:-1], s[1:])] for s in seqs]) % 64
    assert set(steps.unique().tolist()) == {1, 2}


def test_train_refuses_bad_arguments_before_training(tmp_path):
    """``codetta train`` says in one line what would crash later, train nothing or be lost
    after the run: counts below one, a non-finite learning rate, fp16 parameters with AdamW
    and no --amp, a profile window past the run, --out / --save that cannot be written, a
    config file that is not there; and it reads a config file by its own name (a folder's
    config.json beside it once came instead)."""
    from codetta.train import add_arguments, hf_config, train

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    config = _config(tmp_path, "llama")
    base = ["--model", str(config), *COMMON, "--parallel", "none"]
    for extra, why in (
        (["--accum", "-1"], "--accum must be >= 1"), (["--steps", "0"], "--steps must be >= 1"),
        (["--lr", "nan"], "--lr must be a finite number"), (["--seq-len", "1"], "--seq-len must be >= 2"),
        (["--dtype", "fp16"], "fp16 without --amp"), (["--profile", "3", "--time-from", "2"], "runs past"),
        (["--out", str(tmp_path)], "is a folder"), (["--save", "/proc/codetta/w.pt"], "cannot be"),
        (["--model", str(tmp_path / "missing.json")], "no such file"),
        (["--model", "llama3-xyz"], "not a known name"),  # (at once: no hub retries for a typo)
        (["--wrap-base"], "--wrap-base is for --parallel fsdp"),
        (["--precompile", "--no-codetta"], "--precompile compiles codetta's kernels"),
    ):  # fmt: skip
        with pytest.raises(SystemExit, match=why):
            train(parser.parse_args([*base, *extra]))
    other = json.loads(config.read_text())
    # a family this does not train, and a model the drop-in refuses (its reason, one line)
    for name, change, why in (
        ("gpt2.json", {"model_type": "gpt2"}, "model_type 'gpt2' is not one this trains"),
        ("bias.json", {"attention_bias": True}, "o_proj has a bias.*--no-codetta"),
    ):
        (config.parent / name).write_text(json.dumps({**other, **change}))
        with pytest.raises(SystemExit, match=why):
            train(parser.parse_args([*base, "--model", str(config.parent / name)]))
    (config.parent / "other.json").write_text(json.dumps({**other, "num_hidden_layers": 1}))
    assert hf_config(str(config.parent / "other.json"), None, None, 16).num_hidden_layers == 1
    assert hf_config(str(config), None, None, 16).num_hidden_layers == 3


def test_spans_skip_the_module_walk_without_a_process_group(monkeypatch):
    """Without a process group no module can be FSDP2-sharded, so the fused forward's spans
    do not walk every layer's submodules on each forward (host time); with one they do."""
    from codetta.integrations import fsdp

    class Layer(torch.nn.Module):
        walked = 0

        def modules(self):
            Layer.walked += 1
            return super().modules()

    assert not torch.distributed.is_initialized()
    spans = fsdp.Spans([[Layer()], [Layer()]], outer=(Layer(),))
    assert not spans.active and Layer.walked == 0
    monkeypatch.setattr(fsdp, "_distributed", lambda: True)
    assert not fsdp.Spans([[Layer()], [Layer()]], outer=(Layer(),)).active and Layer.walked == 3


def _tiny_llama_config():
    return transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                    num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                    max_position_embeddings=64)  # fmt: skip


@contextlib.contextmanager
def _one_process_group(port_base: int):
    """A gloo process group of this one process (world size 1), destroyed on the way out."""
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port_base + os.getpid() % 300))
    dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_fsdp1_wrapped_layers_run_the_models_own_forward():
    """FSDP1 (FullyShardedDataParallel) gathers a unit's parameters in its own forward,
    which the fused path never calls: a patched model whose decoder layers FSDP1 wraps
    (after the patch, as a training script does) runs its own forward, with the reason,
    and the same loss as the unpatched model under FSDP1 (one process, gloo)."""
    from torch.distributed.fsdp import FullyShardedDataParallel
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    import codetta
    from codetta.integrations import hf

    cfg = _tiny_llama_config()
    with _one_process_group(29600):
        losses = []
        ids = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(0))
        for patch in (False, True):
            torch.manual_seed(0)
            model = transformers.LlamaForCausalLM(cfg)
            if patch:
                codetta.apply_codetta(model)
            layer_cls = type(model.model.layers[0])
            wrapped = FullyShardedDataParallel(model, auto_wrap_policy=ModuleWrapPolicy({layer_cls}),
                                               device_id=torch.device("cpu"))  # fmt: skip
            hf._FALLBACK_WARNED.clear()
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                losses.append(wrapped(input_ids=ids, labels=ids, use_cache=False).loss.item())
            reasons = [str(w.message) for w in caught if "runs its own forward" in str(w.message)]
            assert bool(reasons) == patch and all("FSDP1" in r for r in reasons), reasons
        assert losses[0] == losses[1]


def _sharded_tiny_llama():
    """A patched tiny Llama, each layer and the whole FSDP2-sharded over one process (a
    process group must be up), and a batch of ids."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    import codetta

    torch.manual_seed(0)
    model = codetta.apply_codetta(transformers.LlamaForCausalLM(_tiny_llama_config()))
    mesh = init_device_mesh("cpu", (1,))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(0))


def test_fsdp2_patched_model_is_freed_and_warnings_shown_once():
    """A patched FSDP2 model (one process, gloo) is freed when dropped (the verdict's
    module list is held weakly: FSDP2's hooks lead back to the model, and a strong list in
    the weak table's entry kept it alive for good); FSDP2's view warning for the fused
    spans is filtered once, and another warning issued every step still shows once (a
    catch_warnings around each span once reset the record of warnings shown)."""
    import gc
    import weakref

    from codetta.kernels.settings import override

    def steps():
        model, ids = _sharded_tiny_llama()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("default")
            for _ in range(3):
                model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
                warnings.warn("a user's warning, every step", UserWarning, stacklevel=1)
        return weakref.ref(model), [str(w.message) for w in caught]

    with _one_process_group(29310), override(force_reference=True):
        ref, shown = steps()
        assert shown.count("a user's warning, every step") == 1, shown
        assert not [m for m in shown if "returned a view tensor" in m], shown
        gc.collect()
        assert ref() is None, "the patched FSDP2 model outlived its last reference"


def test_fsdp2_sharded_model_under_autocast_runs_its_own_forward():
    """FSDP2 over float32 parameters under autocast (no MixedPrecisionPolicy): the cast
    mode casts plain parameters only, so the model's own forward runs, with a reason that
    names the mixed-precision policy to use instead (one process, gloo)."""

    from codetta.integrations import hf

    with _one_process_group(29300):
        model, ids = _sharded_tiny_llama()
        hf._FALLBACK_WARNED.clear()
        with warnings.catch_warnings(record=True) as caught, torch.autocast("cpu", dtype=torch.float16):
            warnings.simplefilter("always")
            loss = model(input_ids=ids, labels=ids, use_cache=False).loss
        reasons = [str(w.message) for w in caught if "runs its own forward" in str(w.message)]
        assert len(reasons) == 1 and "MixedPrecisionPolicy" in reasons[0], reasons
        assert torch.isfinite(loss)
