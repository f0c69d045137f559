"""What a new user meets: the same numbers on 1 or 2 cores, exact resume after SIGKILL at any
point (and a damaged checkpoint skipped), one-line errors naming the setting or flag for bad
input, and every config field read from its string form."""

import dataclasses
import json
import math
import os
import shutil
import subprocess
import sys
import typing
from pathlib import Path

import numpy as np
import pytest
from compile_cache import compile_cache_env, compile_cache_in_process
from hypothesis import given, settings
from hypothesis import strategies as st

from sparserl_jax import cli, evaluate, generate, train
from sparserl_jax.config import TrainConfig, dump_config, load_config
from sparserl_jax.config_io import Raw, coerce
from sparserl_jax.run_state import TrainingDiverged
from sparserl_jax.tokenizer import CharTokenizer

TESTS = Path(__file__).parent
REPO = TESTS.parent
SMOKE = str(REPO / "experiments/configs/smoke.yaml")
WORKER = str(TESTS / "reliability_worker.py")


@pytest.fixture(scope="module", autouse=True)
def _compile_cache(tmp_path_factory):
    """The in-process CLIs and trainers repeat one another's programs: with the session's
    compilation cache they compile once (tests/compile_cache.py)."""
    with compile_cache_in_process(tmp_path_factory):
        yield


def _worker(*args, cores=None, env=None):
    cmd = [sys.executable, WORKER, *map(str, args)]
    if cores is not None:
        cmd = ["taskset", "-c", ",".join(map(str, cores)), *cmd]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)


def _finish(proc, timeout=300):
    out, err = proc.communicate(timeout=timeout)
    return proc.returncode, out, err


# ----------------------------------------------------------------------------- 1 vs 2 cores


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2 or not shutil.which("taskset"), reason="needs 2 cores and taskset")
@pytest.mark.slow
def test_same_metrics_on_one_and_two_cores(tmp_path):
    """The default experiment's config (16 rows, a 5-step warm start, 2 iterations) in a
    pinned process (experiments/lib/workers.py) under taskset -c 1 and taskset -c 0,1 (it pins
    itself to core 0 there: the two run side by side). Each compiles for itself (no cache)."""
    cores = sorted(os.sched_getaffinity(0))[:2]
    # at this size the unpinned process gives different metrics on 1 and 2 cores (measured)
    overrides = [
        "sft.steps=5",
        "train.iterations=2",
        "rollout.prompts=2",
        "train.eval_prompts=4",
        "rl.update.minibatch_size=16",
        "rl.update.micro_batch_size=16",
        "train.progress=false",
    ]
    procs = [
        _worker(
            "metrics", tmp_path / f"{n}.json", f"train.out_dir={tmp_path / str(n)}", *overrides, cores=cores[2 - n :]
        )
        for n in (1, 2)
    ]
    for p in procs:
        rc, _, err = _finish(p)
        assert rc == 0, err[-2000:]
    one, two = (json.loads((tmp_path / f"{n}.json").read_text()) for n in (1, 2))
    assert len(one) == 2 and one == two


# ----------------------------------------------------------------------------- SIGKILL and resume


def _params(run_dir):
    from sparserl_jax.checkpoint import Checkpointer

    ckpt = Checkpointer(os.path.join(run_dir, "checkpoints"))
    step = ckpt.latest_step()
    path = os.path.join(ckpt.directory, str(step), "params")
    ckpt.close()
    return step, path


def _tree(run_dir):
    import orbax.checkpoint as ocp

    step, path = _params(run_dir)
    with ocp.StandardCheckpointer() as c:
        return step, c.restore(path)


@pytest.mark.slow
def test_sigkill_anywhere_then_resume_equals_an_uninterrupted_run(tmp_path, tmp_path_factory):
    """Killed between iterations 1 and 2 (before the first checkpoint), then while writing
    checkpoint 4 (after iterations 3 and 4 were logged); each restart resumes. Every metric and
    the final params equal an uninterrupted run's; then a damaged newest checkpoint is skipped.
    The first process compiles; the others load its programs from the session's compilation
    cache (the same executables: resuming is about the state, not the compiler)."""
    base = [
        "train.iterations=4",
        "train.save_every=2",
        "train.keep_checkpoints=3",
        "sft.steps=3",
        "train.progress=false",
    ]
    ref, run = tmp_path / "ref", tmp_path / "run"
    env = compile_cache_env(tmp_path_factory)
    for i, (point, step) in enumerate((("logged", 1), ("checkpoint", 4), ("logged", -1))):
        rc, _, err = _finish(_worker("kill", point, step, f"train.out_dir={run}", *base, env=env))
        assert rc == (0 if step < 0 else -9), err[-2000:]
        if i == 0:  # compiled: the uninterrupted run goes alongside the restarts, on the last core
            reference = _worker(
                "kill", "logged", -1, f"train.out_dir={ref}", *base, env=env, cores=sorted(os.sched_getaffinity(0))[-1:]
            )
    rc, _, err = _finish(reference)
    assert rc == 0, err[-2000:]

    def metrics(d):
        rows = [json.loads(x) for x in (d / "metrics.jsonl").read_text().splitlines()]
        return [{k: v for k, v in r.items() if not k.startswith(("time/", "throughput/"))} for r in rows]

    assert [m["step"] for m in metrics(run)] == [1, 2, 3, 4]
    assert metrics(run) == metrics(ref)
    (s1, p1), (s2, p2) = _tree(run), _tree(ref)
    assert s1 == s2 == 4
    import jax

    for a, b in zip(jax.tree.leaves(p1), jax.tree.leaves(p2)):  # same programs, same machine
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))

    # TensorBoard holds each step once
    from tensorboard.backend.event_processing.event_file_loader import EventFileLoader

    steps = [
        e.step
        for p in sorted((run / "tensorboard").iterdir())
        for e in EventFileLoader(str(p)).Load()
        if e.HasField("summary")
    ]
    assert sorted(steps) == [1, 2, 3, 4]

    # a truncated params file in the newest checkpoint: the one before is restored, with a warning
    from sparserl_jax.checkpoint import Checkpointer

    _, path = _params(run)
    files = sorted((p for p in Path(path).rglob("*") if p.is_file()), key=lambda p: -p.stat().st_size)
    files[0].write_bytes(files[0].read_bytes()[: files[0].stat().st_size // 2])
    ckpt = Checkpointer(str(run / "checkpoints"))
    warnings = []
    like = {"params": p2}
    step, items, _ = ckpt.restore_latest(like, log=warnings.append)
    assert step == 2 and len(warnings) == 1 and "checkpoints/4" in warnings[0]
    # every checkpoint damaged: one error naming the directory
    for s in ckpt.all_steps():
        shutil.rmtree(os.path.join(ckpt.directory, str(s), "params"))
    with pytest.raises(ValueError, match="no intact checkpoint"):
        ckpt.restore_latest(like, log=warnings.append)
    ckpt.close()


def test_training_stops_after_too_many_skipped_iterations(tmp_path, monkeypatch):
    cfg = load_config(
        [SMOKE],
        [
            f"train.out_dir={tmp_path}",
            "sft.steps=0",
            "train.progress=false",
            "train.iterations=10",
            "train.save_every=1",
            "train.max_skipped_iterations=3",
            "train.keep_checkpoints=10",
        ],
    )
    trainer = train.Trainer(cfg, log=lambda *a, **k: None)
    good = {"update/loss": 0.1, "update/skipped": 0.0, "update/steps": 2.0, "reward/mean": 0.0, "kv/saving": 0.0}
    bad = {**good, "update/loss": math.nan, "update/skipped": 2.0}
    script = iter([good, good, bad, bad, bad, good])
    monkeypatch.setattr(trainer, "step", lambda: next(script))
    with pytest.raises(TrainingDiverged, match="max_skipped_iterations=3") as e:
        trainer.run()
    assert "the last one kept is 2" in str(e.value)
    assert trainer.state.ckpt.all_steps() == [1, 2]


# ----------------------------------------------------------------------------- bad input


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    """A training run directory (config + one checkpoint of the initial weights; nothing compiled)."""
    d = tmp_path_factory.mktemp("run")
    cfg = load_config([SMOKE], [f"train.out_dir={d}", "train.progress=false"])
    trainer = train.Trainer(cfg, log=lambda *a, **k: None)
    dump_config(cfg, str(d / "config.yaml"))
    trainer.save()
    trainer.state.ckpt.close()
    return d


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    from hf_fixtures import make_tiny_hf_checkpoint

    d = make_tiny_hf_checkpoint("qwen2", tmp_path_factory.mktemp("hf"))
    CharTokenizer().save(d)
    return d


@pytest.fixture(scope="module")
def nan_hf_dir(tmp_path_factory):
    import torch
    from hf_fixtures import make_tiny_hf_model

    model = make_tiny_hf_model("qwen2")
    with torch.no_grad():
        next(model.parameters()).fill_(float("nan"))
    d = tmp_path_factory.mktemp("nan") / "model"
    model.save_pretrained(d)
    CharTokenizer().save(d)
    config = json.loads((d / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)  # and no chat template
    (d / "tokenizer_config.json").write_text(json.dumps(config))
    return d


T, E, G = "train", "evaluate", "generate"
BAD_INPUT = [  # (cli, arguments, expected exit status, substring of the one-line message)
    (T, ["rl.optim.lr=abc"], 2, "rl.optim.lr='abc'"),
    (T, ["train.seed=abc"], 2, "train.seed='abc'"),
    (T, ["train.save_every=0"], 2, "train.save_every=0 must be >= 1"),
    (T, ["train.save_every=-2"], 2, "train.save_every=-2"),
    (T, ["train.eval_every=-1"], 2, "train.eval_every=-1"),
    (T, ["train.max_skipped_iterations=-1"], 2, "train.max_skipped_iterations"),
    (T, ["rollout.prompts=0"], 2, "rollout.prompts=0"),
    (T, ["kv.compress_prompt=maybe"], 2, "kv.compress_prompt='maybe'"),
    (T, ["model.arch.family=gpt"], 2, "model.arch.family='gpt'"),
    (T, ["data.max_prompt_len=8"], 2, "data.max_prompt_len=8"),
    (T, ["kv.budget=1000"], 2, "kv.budget"),
    (T, ["rl.optim.lr"], 2, "expected key=value"),
    (E, ["--max-new-tokens", "8192"], 2, "--max-new-tokens=8192"),
    (E, ["--kv-policy", "snapkv", "--kv-budget", "100000000"], 2, "--kv-budget=100000000"),
    (E, ["--kv-policy", "snapkv", "--kv-budget", "2"], 2, "--kv-window=4 must be smaller than --kv-budget=2"),
    (E, ["--k", "0"], 2, "--k=0"),
    (E, ["--step", "99"], 2, "--step 99"),
    (E, ["--task", "nope"], 2, "task='nope'"),
    (G, ["--kv-policy", "rkv", "--kv-budget", "100000000"], 2, "--kv-budget=100000000"),
    (G, ["--kv-policy", "rkv", "--kv-budget", "400", "--kv-buffer", "200"], 2, "--kv-buffer=200 is beyond"),
    (G, ["--max-new-tokens", "0"], 2, "--max-new-tokens=0"),
    (G, ["--max-new-tokens", "100000"], 2, "--max-new-tokens=100000"),
    (G, ["--nan-model", "--chat"], 2, "--chat: the tokenizer"),
    (G, ["--nan-model", "--max-new-tokens", "2"], 1, "non-finite"),
    (E, ["--nan-model", "--task", "arithmetic", "--max-new-tokens", "2"], 1, "non-finite"),
]
SUBPROCESS_ROWS = {0, 18}  # also run as real commands (train, generate): no traceback


def _argv(kind, args, tmp, run_dir, hf_dir, nan_hf_dir):
    if kind == T:
        return ["--config", SMOKE, f"train.out_dir={tmp}", *args]
    model = nan_hf_dir if "--nan-model" in args else hf_dir
    args = [a for a in args if a != "--nan-model"]
    if kind == E:
        return ["--checkpoint", str(model if model is nan_hf_dir else run_dir), "--n", "2", *args]
    return ["--checkpoint", str(model), "--prompt", "hi", *args]


@pytest.mark.parametrize("row", range(len(BAD_INPUT)))
def test_bad_input_is_one_line_naming_the_setting(row, tmp_path, capsys, run_dir, hf_dir, nan_hf_dir):
    kind, args, status, message = BAD_INPUT[row]
    argv = _argv(kind, args, tmp_path, run_dir, hf_dir, nan_hf_dir)
    main = {T: train.main, E: evaluate.main, G: generate.main}[kind]
    with pytest.raises(SystemExit) as e:
        cli.run(lambda: main(argv))
    err = capsys.readouterr().err.strip()
    assert e.value.code == status and message in err and len(err.splitlines()) == 1, err
    if kind == T:  # refused before any work (the warm start writes reference/)
        assert not (tmp_path / "reference").exists()
    if row in SUBPROCESS_ROWS:
        proc = subprocess.run(
            [sys.executable, "-m", f"sparserl_jax.{kind}", *argv], capture_output=True, text=True, timeout=300
        )
        assert proc.returncode == status and message in proc.stderr, proc.stderr[-2000:]
        assert "Traceback" not in proc.stderr and len(proc.stderr.strip().splitlines()) == 1


def test_cache_bytes_are_estimated_before_allocating(monkeypatch):
    from sparserl_jax import kvcache as kv
    from sparserl_jax.model.config import ModelConfig

    # the free memory is the test's, not the machine's (which varies with whatever runs beside it)
    monkeypatch.setattr(generate, "free_memory_bytes", lambda: 8 << 30)
    big = ModelConfig(n_layers=64, n_heads=64, n_kv_heads=64, head_dim=256, max_seq_len=1 << 30)
    with pytest.raises(ValueError, match=r"GiB \(64 rows x .* only 8\.0 GiB are free"):
        generate.check_cache(big, kv.KVConfig(policy="rkv", budget=1 << 24, buffer=128), 64, 16, 16)
    assert generate.check_cache(big, kv.KVConfig(), 1, 16, 16) > 0  # 1.1 GiB
    monkeypatch.setattr(generate, "free_memory_bytes", lambda: 1 << 30)
    with pytest.raises(ValueError, match=r"1\.1 GiB \(1 rows x 144 slots\) but only 1\.0 GiB are free"):
        generate.check_cache(big, kv.KVConfig(), 1, 16, 16)


# ----------------------------------------------------------------------------- config coercion


def _leaves(cls, prefix=""):
    for f in dataclasses.fields(cls):
        tp = typing.get_type_hints(cls)[f.name]
        inner = typing.get_args(tp)[0] if type(None) in typing.get_args(tp) else tp
        if dataclasses.is_dataclass(inner):
            yield from _leaves(inner, f"{prefix}{f.name}.")
        else:
            yield f"{prefix}{f.name}", tp


LEAVES = list(_leaves(TrainConfig))
SCI = st.floats(allow_nan=False, allow_infinity=False, width=64)


def _value_and_text(tp, draw):
    """A value of field type `tp` and a string a user could type for it."""
    args = typing.get_args(tp)
    if type(None) in args:
        inner = next(a for a in args if a is not type(None))
        if draw(st.booleans()):
            return None, "null"
        return _value_and_text(inner, draw)
    if set(args) == {int, str}:  # a count or a word (rollout.agreement_k: "auto" or k)
        if draw(st.booleans()):
            return "auto", "auto"
        v = draw(st.integers(0, 10**9))
        return v, str(v)
    if set(args) == {bool, str}:  # a switch or a word (rl.update.remat: true / false or a policy)
        if draw(st.booleans()):
            v = draw(st.sampled_from(["none", "full", "selective"]))
            return v, v
        v = draw(st.booleans())
        return v, draw(st.sampled_from([str(v).lower(), str(v), "yes" if v else "no"]))
    if tp is bool:
        v = draw(st.booleans())
        return v, draw(st.sampled_from([str(v).lower(), str(v), "yes" if v else "no"]))
    if tp is int:
        v = draw(st.integers(-(10**9), 10**9))
        return v, draw(st.sampled_from([str(v), f"{v}.0"]))
    if tp is float:
        v = draw(SCI)
        return v, draw(st.sampled_from([repr(v), f"{v:.17e}", f"{v:.17E}"]))
    if tp is str:
        v = draw(
            st.text(st.characters(blacklist_categories=("Cs",)), min_size=1).filter(
                lambda s: s.strip() not in ("null", "None", "~", "")
            )
        )
        return v, v
    if typing.get_origin(tp) is typing.Literal:
        v = draw(st.sampled_from(args))
        return v, v
    if typing.get_origin(tp) is tuple:  # tuple[int, ...] or tuple[str, ...] (e.g. quant.skip)
        if typing.get_args(tp)[0] is str:
            items = st.text(st.sampled_from("abcdefghij_"), min_size=1, max_size=8)
        else:
            items = st.integers(0, 10**6)
        v = tuple(draw(st.lists(items, max_size=4)))
        return v, draw(st.sampled_from(["[" + ", ".join(map(str, v)) + "]", ",".join(map(str, v))]))
    assert typing.get_origin(tp) in (typing.Mapping, dict) or "Mapping" in str(tp), tp
    v = draw(st.dictionaries(st.sampled_from(["a", "b", "min_pairs"]), st.integers(0, 99), max_size=3))
    return v, json.dumps(v)


@settings(max_examples=300, deadline=None)
@given(st.data())
def test_every_field_round_trips_from_its_string_form(data):
    name, tp = data.draw(st.sampled_from(LEAVES))
    value, text = _value_and_text(tp, data.draw)
    got = coerce(Raw(text), tp, name)
    assert got == value and type(got) is type(value), (name, text, got)


@settings(max_examples=50, deadline=None)
@given(
    st.sampled_from(["abc", "1.5x", "[1, 2]", "{a: 1}"]), st.sampled_from([n for n, t in LEAVES if t in (int, float)])
)
def test_a_bad_number_names_the_setting(text, name):
    with pytest.raises(ValueError, match=name.replace(".", r"\.")):
        load_config([SMOKE], [f"{name}={text}"])


def test_scientific_notation_reaches_the_config():
    cfg = load_config([SMOKE], ["rl.optim.lr=1e-6", "rl.sars.veto_threshold=1E-4", "train.iterations=1e2"])
    assert cfg.rl.optim.lr == 1e-6 and cfg.rl.sars.veto_threshold == 1e-4 and cfg.train.iterations == 100
