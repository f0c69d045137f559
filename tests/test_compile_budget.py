"""The learner's compile budget: how many programs a run compiles before its first update, held
for every real config, and the persistent compilation cache that spares a second run compiling
them again.

A run compiles one scoring and one gradient program per bucket width (rl/buckets.py) and a few
more (rl/bucketed.py BucketedUpdate.warm_up). DOCUMENTED is the table docs/running-on-gpu-tpu.md
states; a real config that would compile more fails here. The widths come from the bucketing
arithmetic of each config as the trainer loads it (with every overlay); the programs per width
from the learner's paths, counted by `learner_programs` and checked against the compilations
jax.monitoring reports, through one trainer iteration of a toy config (default tier) and for the
real configs themselves on a tiny model with their lengths scaled down (slow tier).
"""

import collections
import contextlib
import dataclasses
import os
from pathlib import Path

import jax
import numpy as np
import pytest
from test_rl_update import key, random_params

from sparserl_jax import cli, compile_clock, components
from sparserl_jax.config import load_config
from sparserl_jax.model import precision
from sparserl_jax.model.config import ModelConfig
from sparserl_jax.rl import buckets
from sparserl_jax.rl.bucketed import BucketedUpdate
from sparserl_jax.rl.config import UpdateConfig
from sparserl_jax.rl.optim import make_optimizer
from sparserl_jax.rollout.sampling import kept_width

REPO = Path(__file__).parent.parent
REAL = REPO / "experiments/configs/real"
SMOKE = str(REPO / "experiments/configs/smoke.yaml")
# the overlays a real-model config is combined with (its header's commands): the mesh sets the
# micro-batch sizes, the policy the eviction; none changes the widths or the programs
OVERLAYS = [None, *sorted(str(p) for p in (REAL / "mesh").glob("*.yaml")), str(REAL / "policy/snapkv.yaml")]
SMALL = ("smollm2_chat_arithmetic", "smollm2_collapse")  # one-CPU configs: no mesh overlay

# config -> (bucket widths, programs compiled before the first update): docs/running-on-gpu-tpu.md
DOCUMENTED = {
    "llama-3.2-1b-instruct": (16, 37),
    "qwen2.5-1.5b": (16, 37),
    "qwen2.5-3b": (16, 37),
    "qwen2.5-7b": (16, 37),
    "smollm2_chat_arithmetic": (6, 22),
    "smollm2_collapse": (5, 19),
}


def test_every_real_config_is_documented():
    assert sorted(p.stem for p in REAL.glob("*.yaml")) == sorted(DOCUMENTED)


# ----------------------------------------------------------------------------- widths


def test_max_buckets_bounds_the_widths_and_keeps_small_configs():
    assert buckets.bucket_widths(12, 4, 3) == buckets.bucket_widths(12, 4) == (4, 8, 12)
    assert buckets.bucket_widths(12, 4, 2) == (8, 12)  # 3 multiples of 4 > 2: a step of 8
    assert buckets.bucket_widths(10, 4, 2) == (8, 10)
    assert buckets.bucket_widths(12, 4, 1) == buckets.bucket_widths(12, 0, 5) == (12,)
    assert buckets.bucket_step(5120, 64, 16) == 320 and len(buckets.bucket_widths(5120, 64, 16)) == 16
    for full in range(1, 300, 7):
        for bucket in (0, 1, 3, 16, 64):
            for cap in (0, 1, 2, 5, 16):
                widths = buckets.bucket_widths(full, bucket, cap)
                step = buckets.bucket_step(full, bucket, cap)
                assert widths[-1] == full and list(widths) == sorted(set(widths))
                assert all(w % step == 0 for w in widths[:-1]) and (bucket == 0 or step % bucket == 0)
                assert cap == 0 or len(widths) <= cap
                if cap == 0 or len(buckets.bucket_widths(full, bucket)) <= cap:  # within the bound: unchanged
                    assert widths == buckets.bucket_widths(full, bucket)
    with pytest.raises(ValueError, match=r"update\.max_buckets=-1 must be >= 0"):
        UpdateConfig(max_buckets=-1)
    # the default bound changes nothing up to 2048-position rows at the default bucket
    u = UpdateConfig()
    assert buckets.bucket_widths(2048, u.length_bucket, u.max_buckets) == buckets.bucket_widths(2048, u.length_bucket)


def _loaded(name: str):
    """Each way the trainer loads a real config: alone and with each overlay (the one-CPU configs
    alone)."""
    path = str(REAL / f"{name}.yaml")
    overlays = [None] if name in SMALL else OVERLAYS
    return [load_config([path] + ([o] if o else [])) for o in overlays]


def _update(cfg, model_cfg=None) -> tuple[BucketedUpdate, int, int]:
    """The learner's update as Trainer builds it for `cfg` (on a tiny model in `cfg`'s dtypes), and
    its batch shape [B, T]."""
    r = cfg.rollout
    model_cfg = model_cfg or ModelConfig.tiny(dtype=cfg.model.dtype, param_dtype=cfg.model.param_dtype)
    max_len = cfg.data.max_prompt_len + r.max_new_tokens
    update = BucketedUpdate(
        model_cfg,
        cfg.rl,
        make_optimizer(cfg.rl.optim),
        max_len=max_len,
        kept_k=kept_width(r.top_k) if r.filters else 0,
        top_k=components.agreement_candidates(cfg),
    )
    return update, r.rows, max_len


def learner_programs(update: BucketedUpdate, B: int, T: int) -> int:
    """The programs BucketedUpdate.warm_up compiles for [B, T] batches: per width, pi_old's
    scoring (unless every path takes it from the update's forward), pi_ref's where it is scored
    with top candidates outside the micro-batch, and a gradient program per (fused, ref_inside)
    path; then the optimizer step, the accumulator's zeros, the mismatch metrics, the re-cast of
    the compute copy (mixed precision) and the row normalisers (a scored path)."""
    paths, with_ref = update.paths(B), update.cfg.loss.beta > 0
    all_fused = all(p.fused for p in paths)
    per_width = (
        (not all_fused)
        + (with_ref and not all(p.ref_inside for p in paths) and update.top_k > 0)
        + len({(p.fused, p.ref_inside) for p in paths})
    )
    return len(update.widths(T)) * per_width + 3 + update.mixed + (not all_fused)


@pytest.mark.parametrize("name", sorted(DOCUMENTED))
def test_real_config_compiles_the_documented_programs(name):
    """Exact and cheap: the config's widths from the bucketing arithmetic, its programs from the
    learner's paths (no compilation)."""
    for cfg in _loaded(name):
        update, B, T = _update(cfg)
        assert (len(update.widths(T)), learner_programs(update, B, T)) == DOCUMENTED[name], cfg.mesh


# ----------------------------------------------------------------------------- counted

# the names jax gives the learner's programs (rl/bucketed.py: the scorer, the micro-batch step, the
# optimizer step, the accumulator's zeros and the compute copy's re-cast (lambdas), the mismatch
# metrics, the row normalisers); "stage" lifts a host array onto the device (one per shape)
LEARNER = {"_score_rows", "_micro_step", "_apply", "<lambda>", "mismatch_metrics", "row_weight_normalisers"}


@contextlib.contextmanager
def compiled_programs():
    """The names of the programs compiled inside the block (jax.monitoring's backend compilations)."""
    names = []

    def listener(event, duration, **kwargs):
        if event == compile_clock.BACKEND_COMPILE:
            names.append(kwargs.get("fun_name", "").removeprefix("jit(").removesuffix(")"))

    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        yield names
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)


@pytest.mark.extended  # 25 s; the default tier checks the widths and program arithmetic
@pytest.mark.slow
def test_one_trainer_iteration_compiles_the_counted_learner_programs(tmp_path):
    """The toy config with a bound that widens its step (48-position rows, length_bucket 8,
    max_buckets 3: widths 16, 32, 48), mixed precision and both the fused and the scored path
    possible (one minibatch): the learner's first step compiles `learner_programs` of its
    programs (and single operations: host arrays lifted, scalar sums, the diagnostics), its second
    step compiles nothing."""
    from sparserl_jax.train import Trainer

    cfg = load_config(
        [SMOKE],
        [
            f"train.out_dir={tmp_path}",
            "sft.steps=0",
            "model.dtype=bfloat16",
            "rl.update.minibatch_size=16",
            "rl.update.compile_ahead=true",
            "rl.update.length_bucket=8",
            "rl.update.max_buckets=3",
        ],
    )
    trainer = Trainer(cfg, log=lambda *a, **k: None)
    trainer.start()
    update = trainer.learner.update
    B, T = cfg.rollout.rows, cfg.data.max_prompt_len + cfg.rollout.max_new_tokens
    assert update.widths(T) == (16, 32, 48) and len(update.paths(B)) == 2 and update.mixed
    counted = []
    for iteration in range(2):
        policy = trainer.learner.compute_copy(trainer.params)
        batch, _, _ = trainer.rollout_batch(jax.random.key(iteration), policy)
        with compiled_programs() as names:
            trainer.params, trainer.opt_state, _ = trainer.learner.step(
                trainer.params, trainer.ref_params, trainer.opt_state, batch, iteration, compute=policy
            )
        counted.append(names)
    learner = collections.Counter(n for n in counted[0] if n in LEARNER)
    assert sum(learner.values()) == learner_programs(update, B, T) == 14, learner
    assert learner["_score_rows"] == 3 and learner["_micro_step"] == 6  # a width: 1 scoring, 2 paths
    assert counted[1] == []


def _scaled(cfg, by: int):
    """`cfg` with its lengths and bucket divided by `by`: the same widths / `by`, so the same
    number of programs, at a size a tiny model compiles in a fraction of a second."""
    u = cfg.rl.update
    for n in (cfg.data.max_prompt_len, cfg.rollout.max_new_tokens, u.length_bucket):
        assert n % by == 0, (n, by)
    rl = dataclasses.replace(cfg.rl, update=dataclasses.replace(u, length_bucket=u.length_bucket // by))
    return dataclasses.replace(
        cfg,
        data=dataclasses.replace(cfg.data, max_prompt_len=cfg.data.max_prompt_len // by),
        rollout=dataclasses.replace(cfg.rollout, max_new_tokens=cfg.rollout.max_new_tokens // by),
        rl=rl,
    )


@pytest.mark.extended
@pytest.mark.slow
@pytest.mark.parametrize("name", ["qwen2.5-1.5b", *SMALL])
def test_real_config_warm_up_compiles_the_documented_programs(name):
    """The real config's own learner settings (batch, micro-batches, paths, dtypes) on a tiny
    model, lengths scaled down: warm_up compiles the documented programs and nothing else but host
    arrays lifted (the other big configs share qwen2.5-1.5b's settings)."""
    cfg = load_config([str(REAL / f"{name}.yaml")])
    full = _update(cfg)[0].widths(cfg.data.max_prompt_len + cfg.rollout.max_new_tokens)
    by = 16 if name in SMALL else 64
    cfg = _scaled(cfg, by)
    update, B, T = _update(cfg)
    assert tuple(w * by for w in update.widths(T)) == full  # the same bucketing, scaled
    params = random_params(update.model_cfg, key(0))
    ref = precision.compute_copy(params, update.model_cfg)
    opt_state = update.optimizer.init(params)
    with compiled_programs() as names:
        update.warm_up(params, ref, opt_state, B, T)
    assert set(names) <= LEARNER | {"stage"}, set(names)
    assert sum(n in LEARNER for n in names) == learner_programs(update, B, T) == DOCUMENTED[name][1]


# ----------------------------------------------------------------------------- padding


def long_tail_lengths(rows: int, response_median: float, seed: int = 0) -> np.ndarray:
    """Row lengths (prompt + response) of a synthetic batch of 4096-token responses: prompts
    lognormal around 130 tokens (MATH questions in a template), responses lognormal around
    `response_median` with a long tail cut at 4096 (rl/buckets.py's figures)."""
    rng = np.random.default_rng(seed)
    prompts = np.clip(rng.lognormal(np.log(130), 0.45, rows), 40, 1024).astype(np.int64)
    sigma = 0.75 if response_median < 1000 else 0.8
    responses = np.clip(rng.lognormal(np.log(response_median), sigma, rows), 20, 4096).astype(np.int64)
    return prompts + responses


def update_positions(lengths_B: np.ndarray, minibatch: int, micro: int, widths) -> int:
    """Positions the update runs: every minibatch's rows sorted by length into micro-batches, each
    at its width (rl/bucketed.py's grouped path)."""
    return sum(
        len(mb.rows) * mb.width
        for start in range(0, len(lengths_B), minibatch)
        for mb in buckets.plan(lengths_B, np.arange(start, start + minibatch), micro, widths, group=True)
    )


@pytest.mark.parametrize("median, expected", [(700, (2.8, 11.8, 14.9, 23.0)), (1500, (1.6, 6.6, 8.8, 13.4))])
def test_padding_of_coarser_buckets_on_a_long_tail(median, expected):
    """rl/buckets.py's figures: the positions the real configs' micro-batches of 4 run beyond
    their longest rows (each at its own length) at steps of 64, 256, 320 and 512 positions."""
    lengths = long_tail_lengths(1024, median)
    exact = update_positions(lengths, 256, 4, tuple(range(1, 5121)))
    got = []
    for cap in (0, 20, 16, 10):
        widths = buckets.bucket_widths(5120, 64, cap)
        got.append(100 * (update_positions(lengths, 256, 4, widths) / exact - 1))
    assert got == sorted(got)  # coarser costs more
    np.testing.assert_allclose(got, expected, atol=0.5)


# ----------------------------------------------------------------------------- the cache


@pytest.fixture
def jax_cache_config(monkeypatch):
    """JAX's cache settings restored after the test (and its cache state reset), with no folder
    named by JAX or $SPARSERL_COMPILE_CACHE to start from."""
    from jax.experimental.compilation_cache import compilation_cache

    names = ("jax_compilation_cache_dir", "jax_persistent_cache_min_compile_time_secs")
    saved = {n: getattr(jax.config, n) for n in names}
    monkeypatch.delenv(cli.COMPILE_CACHE_ENV, raising=False)
    jax.config.update("jax_compilation_cache_dir", None)
    try:
        yield
    finally:
        for n, v in saved.items():
            jax.config.update(n, v)
        compilation_cache.reset_cache()


def test_compile_cache_folder_setting_environment_and_cpu(monkeypatch, tmp_path):
    monkeypatch.delenv(cli.COMPILE_CACHE_ENV, raising=False)
    assert cli.compile_cache_folder("", "cpu") is None and cli.compile_cache_folder(None, "gpu") is None
    assert cli.compile_cache_folder(str(tmp_path), "gpu") == str(tmp_path)
    home = os.path.expanduser("~")
    assert cli.compile_cache_folder(cli.DEFAULT_COMPILE_CACHE, "gpu") == os.path.join(home, ".cache/sparserl_jax/xla")
    cpu = cli.compile_cache_folder(str(tmp_path), "cpu")  # a folder per instruction set
    assert os.path.dirname(cpu) == str(tmp_path) and os.path.basename(cpu) == f"cpu-{cli.host_isa()}"
    assert len(cli.host_isa()) == 12 and cli.host_isa() == cli.host_isa()
    monkeypatch.setenv(cli.COMPILE_CACHE_ENV, "")  # the suite's setting (tests/conftest.py): off
    assert cli.compile_cache_folder(str(tmp_path), "gpu") is None
    monkeypatch.setenv(cli.COMPILE_CACHE_ENV, str(tmp_path / "env"))
    assert cli.compile_cache_folder("", "gpu") == str(tmp_path / "env")


def test_a_fresh_program_loads_from_the_cache_the_second_time(jax_cache_config, monkeypatch, tmp_path):
    """use_compile_cache turns the cache on: the same program in a new jit (as a new process, or a
    trainer built afresh, has it) is loaded, not compiled; a folder JAX already names is kept."""
    monkeypatch.setattr(cli, "MIN_COMPILE_SECS", 0.0)  # the toy program compiles in milliseconds
    folder = cli.use_compile_cache(str(tmp_path))
    assert folder == cli.compile_cache_folder(str(tmp_path), jax.default_backend())
    assert jax.config.jax_compilation_cache_dir == folder

    def program():
        return jax.jit(lambda x: jax.numpy.sin(x) * 3.0 + 1.0)(np.arange(7.0, dtype=np.float32))

    counts = []
    for _ in range(2):
        since = compile_clock.Since()
        program()
        counts.append((since.compiles, since.cache_hits))
    assert counts == [(1, 0), (1, 1)]
    assert any(os.scandir(folder))
    assert cli.use_compile_cache(str(tmp_path / "other")) == folder  # JAX's folder is kept


def test_off_leaves_jax_without_a_cache(jax_cache_config):
    assert cli.use_compile_cache("") is None and cli.use_compile_cache(None) is None
    assert jax.config.jax_compilation_cache_dir is None


def test_the_train_command_turns_the_cache_on(jax_cache_config, monkeypatch, tmp_path):
    """`python -m sparserl_jax.train` turns train.compile_cache on before the trainer is built
    (a stand-in trainer: the wiring, not a run), and "" leaves it off."""
    from sparserl_jax import train

    seen = []

    class Recorder:
        def __init__(self, cfg):
            seen.append(jax.config.jax_compilation_cache_dir)

        def run(self):
            return []

    monkeypatch.setattr(train, "Trainer", Recorder)
    train.main(["--config", SMOKE, "train.compile_cache="])
    train.main(["--config", SMOKE, f"train.compile_cache={tmp_path}"])
    assert seen == [None, cli.compile_cache_folder(str(tmp_path), jax.default_backend())]


@pytest.mark.extended
@pytest.mark.slow
def test_a_second_training_run_loads_its_programs_from_the_cache(jax_cache_config, monkeypatch, tmp_path):
    """`python -m sparserl_jax.train` twice on the toy config with train.compile_cache: the first
    run writes its programs, the second (a new trainer: new jitted closures, as in a new process)
    loads them and spends less time compiling."""
    from sparserl_jax import train

    monkeypatch.setattr(cli, "MIN_COMPILE_SECS", 0.0)  # every program: how long each takes varies
    runs = []
    for run in ("a", "b"):
        since = compile_clock.Since()
        train.main(
            [
                "--config",
                SMOKE,
                f"train.out_dir={tmp_path / run}",
                f"train.compile_cache={tmp_path / 'cache'}",
                "train.iterations=1",
                "sft.steps=2",
                "train.progress=false",
            ]
        )
        runs.append((since.compiles, since.cache_hits, since.seconds))
    (compiled_a, hits_a, seconds_a), (compiled_b, hits_b, seconds_b) = runs
    assert hits_a == 0 and compiled_a > 10, runs
    assert hits_b >= 0.8 * compiled_b, runs  # loaded; the rest hold host callbacks (not cached)
    assert seconds_b < seconds_a, runs


def test_the_device_check_passes_its_cache_to_every_step(monkeypatch, tmp_path):
    """gpu_check.py --compile-cache: each step's process gets the folder in JAX's own variables,
    unless the user set them; '' (or $SPARSERL_COMPILE_CACHE='') leaves the steps without one."""
    from experiments.device import gpu_check

    monkeypatch.delenv("JAX_COMPILATION_CACHE_DIR", raising=False)
    monkeypatch.delenv(cli.COMPILE_CACHE_ENV, raising=False)
    folder = cli.compile_cache_folder(gpu_check.parse_args(["--compile-cache", str(tmp_path)]).compile_cache, "gpu")
    env = gpu_check.step_env("update", "full", folder)
    assert env["JAX_COMPILATION_CACHE_DIR"] == str(tmp_path)
    assert float(env["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"]) == cli.MIN_COMPILE_SECS
    assert gpu_check.parse_args([]).compile_cache == cli.DEFAULT_COMPILE_CACHE
    assert "JAX_COMPILATION_CACHE_DIR" not in gpu_check.step_env("update", "full", cli.compile_cache_folder("", "gpu"))
    monkeypatch.setenv("JAX_COMPILATION_CACHE_DIR", "/theirs")  # the user's wins
    assert gpu_check.step_env("e2e", "smoke", folder)["JAX_COMPILATION_CACHE_DIR"] == "/theirs"
