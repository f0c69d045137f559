"""TRL's GRPOTrainer and our Trainer on the same GRPO workload, one pinned CPU core each.

  python experiments/bench/bench_vs_trl.py            # experiments/results/bench_vs_trl.{json,md}
  python experiments/bench/bench_vs_trl.py --regimes fixed --compute-dtype float32 bfloat16 \
      --out experiments/results/bench_vs_trl_dtypes.json    # both precisions in one run
  python experiments/bench/bench_vs_trl.py --smoke --checkpoint <tiny HF checkpoint>   # seconds (tests)

Workload (both arms): experiments/configs/real/smollm2_chat_arithmetic.yaml with dense rollouts
(rl.mode=dense kv.policy=none): SmolLM2-135M-Instruct in float32 (--compute-dtype bfloat16: bfloat16
compute over float32 master weights and optimizer state on both sides), 4 prompts x 4 samples of chat
arithmetic, up to 256 new tokens at temperature 0.7, lr 1e-5, beta 1e-4, one optimizer step per
rollout batch. TRL: GRPOConfig(per_device_train_batch_size=16, num_generations=4, the same lengths,
temperature, beta and lr; steps_per_generation = num_iterations = 1, so neither side scores pi_old
apart from the update). Both draw the same prompts in the same order.

Regimes (one after the other; in each, the two arms run at the same time, ours on the first core,
TRL on the second, one process and one thread each):
  natural  responses end at end-of-sequence: lengths differ between the arms, so the figures are
           per response token over every measured iteration;
  fixed    every response is exactly --fixed-tokens long (ours: rollout.ignore_eos; TRL:
           generation_kwargs min_new_tokens): each phase compared at equal work.
With one core available (a taskset of one), the two arms run one after the other on it. With
several --compute-dtype values, every regime runs in each, and the report adds each side at its
best precision (the fewest seconds per response token) against the other's.
Each arm runs --warmup iterations (compilation, caches) before --iterations measured ones.
Phases: rollout (sampling), scoring (teacher-forced pi_old / pi_ref outside the gradient pass),
update (learner forward, backward, optimizer), other (rewards, advantages, batch assembly,
diagnostics); iteration = all of them. In our process the same rollout batches also go, before our
learner, through the padded learner of the previous version (pi_old and pi_ref scored apart, every
row padded to the batch's full width, one program: rl.update.make_update_fn) on a copy of the
weights: the learner's speed-up on identical batches, side by side. Our rollout's milliseconds per
decode step in training stand next to `generate` outside training at the same batch, sampling and
prompts with exactly --decode-steps new tokens (bench_vs_hf's measurement), on the same core.
Compilation is left out the same way everywhere: only iterations after the warm-up are timed, and
JAX compilations inside timed iterations are counted (ours must have none), with their seconds as
sparserl_jax.compile_clock counts them (tracing, lowering and compiling, each second once).
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import statistics
import sys
import tempfile
import time

from experiments.lib import figprov, workers  # import no JAX
from experiments.real.smoke import SMOKE_BATCH, load_real_config

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # experiments/
REPO = os.path.dirname(HERE)
CONFIG = os.path.join(HERE, "configs", "real", "smollm2_chat_arithmetic.yaml")
OVERRIDES = ("rl.mode=dense", "kv.policy=none", "train.progress=false", "train.save_every=100000", "train.eval_every=0")
SMOKE = (*SMOKE_BATCH, "rollout.max_new_tokens=8")
PHASES = ("rollout", "score", "update", "other")
COMPUTE_DTYPES = ("float32", "bfloat16")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--regimes", nargs="+", default=["natural", "fixed"], choices=["natural", "fixed"])
    p.add_argument("--warmup", type=int, default=1, help="untimed iterations per arm and regime")
    p.add_argument("--iterations", type=int, default=6, help="timed iterations per arm and regime")
    p.add_argument("--fixed-tokens", type=int, default=128, help="response length of the fixed regime")
    p.add_argument("--decode-steps", type=int, default=64, help="new tokens of the generate reference")
    p.add_argument("--checkpoint", default=None, help="an HF checkpoint in place of the config's")
    p.add_argument("--no-padded-reference", action="store_true")
    p.add_argument(
        "--trl-host-memory",
        choices=("system", "reuse"),
        default="system",
        help="TRL's process's malloc (sparserl_jax/host_memory.py): system, as its users run it, or reuse, as ours",
    )
    p.add_argument(
        "--compute-dtype",
        dest="compute_dtypes",
        nargs="+",
        choices=COMPUTE_DTYPES,
        default=["float32"],
        help="both arms' compute dtype over float32 master weights (ours: model.dtype; TRL: "
        "bf16 autocast, GRPOConfig(bf16=True)); several: each in turn, side by side in the report",
    )
    p.add_argument("--smoke", action="store_true", help="tiny workload, one iteration each")
    p.add_argument("--out", default=os.path.join(HERE, "results", "bench_vs_trl.json"))
    p.add_argument("overrides", nargs="*", help="key=value settings for our config (e.g. rl.loss.beta=0)")
    args = p.parse_args(argv)
    if args.smoke:
        args.warmup, args.iterations, args.fixed_tokens, args.decode_steps = 1, 1, 8, 4
    return args


def our_config(args, regime: str, out_dir: str):
    over = [
        *OVERRIDES,
        *(SMOKE if args.smoke else ()),
        f"train.out_dir={out_dir}",
        f"train.iterations={args.warmup + args.iterations}",
        f"model.dtype={args.compute_dtype}",  # the compute dtype; master weights stay float32
    ]
    if args.checkpoint:
        over.append(f"model.checkpoint={args.checkpoint}")
    if regime == "fixed":
        over += ["rollout.ignore_eos=true", f"rollout.max_new_tokens={args.fixed_tokens}"]
    return load_real_config(over + list(args.overrides), CONFIG)


# ----------------------------------------------------------------------------- ours


def _padded_learner(trainer):
    """The previous learner: pi_old and pi_ref scored apart, then the one-program update, on the
    batch's full width; returns a function timing both on a copy of the weights."""
    import jax
    import jax.numpy as jnp

    from sparserl_jax.rl.update import make_score_fn, make_update_fn

    cfg = trainer.cfg.rl
    score = make_score_fn(trainer.model_cfg, cfg.update)
    update = make_update_fn(trainer.model_cfg, cfg, trainer.learner.optimizer, donate=False)

    def run(params, ref_params, opt_state, host_batch) -> dict:
        batch = {k: jnp.asarray(v) for k, v in host_batch.items()}
        t0 = time.perf_counter()
        batch["old_logp"] = score(params, batch["tokens"])
        batch["ref_logp"] = score(ref_params, batch["tokens"])
        jax.block_until_ready(batch["ref_logp"])
        t1 = time.perf_counter()
        out = update(params, opt_state, batch)
        jax.block_until_ready(out)
        return {"score_s": t1 - t0, "update_s": time.perf_counter() - t1}

    return run


def _generate_reference(trainer, examples, steps: int) -> dict:
    """`generate` outside training: the training batch's prompts and sampling, exactly `steps` new
    tokens (no end-of-sequence stop), compiled first, then timed once."""
    import dataclasses

    import jax
    import numpy as np

    from sparserl_jax.rollout.prompts import pad_prompt_batch
    from sparserl_jax.rollout.sampler import generate_jit

    cfg = trainer.cfg
    ids = [list(e.prompt_ids) for e in examples for _ in range(cfg.rollout.samples)]
    tokens, lengths = pad_prompt_batch(ids, trainer.tokenizer.pad_token_id, cfg.data.max_prompt_len)
    sampler = dataclasses.replace(trainer.sampler_cfg, max_new_tokens=steps, eos_token_ids=())
    key = jax.random.key(1234)
    args = (trainer.params, trainer.model_cfg, tokens, lengths, key, sampler, np.arange(len(ids), dtype=np.int32))
    jax.block_until_ready(generate_jit(*args))  # compile
    t0 = time.perf_counter()
    jax.block_until_ready(generate_jit(*args))
    seconds = time.perf_counter() - t0
    return {"rows": len(ids), "steps": steps, "seconds": seconds, "ms_per_step": 1e3 * seconds / steps}


def run_ours(job) -> dict:
    args, regime = job
    import jax

    from sparserl_jax import compile_clock
    from sparserl_jax.train import Trainer

    with tempfile.TemporaryDirectory() as out_dir:
        cfg = our_config(args, regime, out_dir)
        trainer = Trainer(cfg, log=lambda *a, **k: None)
        trainer.start()
        padded = None if args.no_padded_reference else _padded_learner(trainer)
        U, M = cfg.kv.buffer, cfg.rollout.max_new_tokens
        rows, first_examples = [], None
        for it in range(args.warmup + args.iterations):
            since = compile_clock.Since()  # compile time as every benchmark counts it
            t0 = time.perf_counter()
            key = jax.random.fold_in(jax.random.key(cfg.train.seed), trainer.iteration)
            rollout = trainer.source.next(trainer.params, key, trainer.iteration)
            first_examples = first_examples or rollout.examples
            batch, metrics, _ = trainer.learner.batch(rollout)
            t1 = time.perf_counter()
            ref = padded(trainer.params, trainer.ref_params, trainer.opt_state, batch) if padded else {}
            ref_compiles, since = (since.compiles, since.seconds), compile_clock.Since()
            t2 = time.perf_counter()
            trainer.params, trainer.opt_state, learned = trainer.learner.step(
                trainer.params, trainer.ref_params, trainer.opt_state, batch, trainer.iteration
            )
            t3 = time.perf_counter()
            trainer.iteration += 1
            lengths = rollout.out.lengths
            steps = min(-(-int(lengths.max()) // U), -(-M // U)) * U
            roll = rollout.metrics["time/rollout_s"]
            learn = learned["time/score_s"] + learned["time/update_s"]
            n_compiles, compile_s = since.compiles, since.seconds
            rows.append(
                {
                    "iteration": it,
                    "warmup": it < args.warmup,
                    "tokens": int(lengths.sum()),
                    "length_mean": float(lengths.mean()),
                    "rows": int(lengths.size),
                    "rollout_s": roll,
                    "score_s": learned["time/score_s"],
                    "update_s": learned["time/update_s"],
                    "other_s": (t1 - t0 - roll) + (t3 - t2 - learn),
                    "iteration_s": (t1 - t0) + (t3 - t2),
                    "decode_steps": steps,
                    "decode_ms_per_step": 1e3 * roll / steps,
                    "padding_fraction": learned["update/padding_fraction"],
                    "reward": metrics["reward/mean"],
                    "compiles": n_compiles,
                    "compile_s": compile_s,
                    **(
                        {
                            "padded_score_s": ref["score_s"],
                            "padded_update_s": ref["update_s"],
                            "padded_compiles": ref_compiles[0],
                            "padded_compile_s": ref_compiles[1],
                        }
                        if ref
                        else {}
                    ),
                }
            )
        generate = _generate_reference(trainer, first_examples, args.decode_steps)
    return {
        "arm": "ours",
        "regime": regime,
        "iterations": rows,
        "generate_reference": generate,
        "host_memory": trainer.host_memory,
        "jax": jax.__version__,
        "config": _config_dict(cfg),
    }


def _config_dict(cfg) -> dict:
    from sparserl_jax.config import to_dict

    return to_dict(cfg)


# ----------------------------------------------------------------------------- TRL


def _trl_dataset(cfg, n_steps: int):
    """The prompts our Trainer draws (batch k = task.sample(rng(seed, k))), as TRL rows."""
    import numpy as np
    from datasets import Dataset

    from sparserl_jax.data.tasks import get_task

    task = get_task(cfg.data.task, **dict(cfg.data.task_options))
    rows = []
    for k in range(n_steps):
        for question, label in task.sample(np.random.default_rng([cfg.train.seed, k]), cfg.rollout.prompts):
            rows.append({"prompt": [{"role": "user", "content": question}], "label": label})
    return Dataset.from_list(rows), task


def run_trl(job) -> dict:
    args, regime = job
    from sparserl_jax import host_memory

    memory = host_memory.configure(args.trl_host_memory)  # before torch starts its threads
    import torch

    torch.set_num_threads(1)
    import transformers
    import trl
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback

    cfg = our_config(args, regime, tempfile.mkdtemp())
    r, u = cfg.rollout, cfg.rl
    n = args.warmup + args.iterations
    dataset, task = _trl_dataset(cfg, n)
    torch.manual_seed(cfg.train.seed)
    model = AutoModelForCausalLM.from_pretrained(cfg.model.checkpoint, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(cfg.model.checkpoint)
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token

    def reward(completions, label, **_):
        return [task.reward(c[0]["content"], lab) for c, lab in zip(completions, label)]

    timers = {"rollout": 0.0, "score": 0.0, "gen_and_score": 0.0, "tokens": 0, "rows": 0}

    class Timed(trl.GRPOTrainer):
        def _generate(self, prompts):
            t0 = time.perf_counter()
            out = super()._generate(prompts)
            timers["rollout"] += time.perf_counter() - t0
            return out

        def _get_per_token_logps_and_entropies(self, *a, **k):
            if torch.is_grad_enabled():
                return super()._get_per_token_logps_and_entropies(*a, **k)
            t0 = time.perf_counter()
            out = super()._get_per_token_logps_and_entropies(*a, **k)
            timers["score"] += time.perf_counter() - t0
            return out

        def _generate_and_score_completions(self, inputs):
            t0 = time.perf_counter()
            out = super()._generate_and_score_completions(inputs)
            timers["gen_and_score"] += time.perf_counter() - t0
            mask = out["completion_mask"]
            timers["tokens"] += int(mask.sum())
            timers["rows"] += int(mask.shape[0])
            return out

    rows = []

    class Steps(TrainerCallback):
        def on_step_begin(self, *_, **__):
            for k in timers:
                timers[k] = 0
            self.t0 = time.perf_counter()

        def on_step_end(self, *_, **__):
            total = time.perf_counter() - self.t0
            it = len(rows)
            other = timers["gen_and_score"] - timers["rollout"] - timers["score"]
            rows.append(
                {
                    "iteration": it,
                    "warmup": it < args.warmup,
                    "tokens": timers["tokens"],
                    "rows": timers["rows"],
                    "length_mean": timers["tokens"] / max(timers["rows"], 1),
                    "rollout_s": timers["rollout"],
                    "score_s": timers["score"],
                    "update_s": total - timers["gen_and_score"],
                    "other_s": other,
                    "iteration_s": total,
                }
            )

    gen_kwargs = {"min_new_tokens": args.fixed_tokens} if regime == "fixed" else {}
    with tempfile.TemporaryDirectory() as out_dir:
        targs = trl.GRPOConfig(
            output_dir=out_dir,
            per_device_train_batch_size=r.rows,
            num_generations=r.samples,
            max_completion_length=r.max_new_tokens,
            temperature=r.temperature,
            top_p=1.0,
            beta=u.loss.beta,
            learning_rate=u.optim.lr,
            weight_decay=u.optim.weight_decay,
            adam_beta1=u.optim.b1,
            adam_beta2=u.optim.b2,
            max_grad_norm=u.optim.grad_clip,
            lr_scheduler_type="constant",
            max_steps=n,
            logging_steps=1,
            report_to="none",
            save_strategy="no",
            use_cpu=True,
            bf16=args.compute_dtype == "bfloat16",  # autocast over the float32 model loaded above
            seed=cfg.train.seed,
            shuffle_dataset=False,
            generation_kwargs=gen_kwargs,
            dataloader_num_workers=0,
            disable_tqdm=True,
        )
        trainer = Timed(
            model=model,
            reward_funcs=reward,
            args=targs,
            train_dataset=dataset,
            processing_class=tok,
            callbacks=[Steps()],
        )
        trainer.train()
    return {
        "arm": "trl",
        "regime": regime,
        "iterations": rows,
        "host_memory": memory,
        "trl": trl.__version__,
        "transformers": transformers.__version__,
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
    }


def run_arm(job) -> dict:
    """One arm of one regime (a worker process): job = (args, regime, "ours" | "trl")."""
    return (run_ours if job[2] == "ours" else run_trl)(job[:2])


# ----------------------------------------------------------------------------- report


def summarise(rows: list[dict], *, padded: bool = False) -> dict:
    timed = [r for r in rows if not r["warmup"]] or rows
    tokens = sum(r["tokens"] for r in timed)
    tot = lambda k: sum(r[k] for r in timed)  # noqa: E731
    out = {"iterations": len(timed), "tokens": tokens, "length_mean": tokens / max(sum(r["rows"] for r in timed), 1)}
    for p in (*PHASES, "iteration"):
        out[f"{p}_s"] = tot(f"{p}_s") / len(timed)
        out[f"{p}_s_per_token"] = tot(f"{p}_s") / max(tokens, 1)
    out["learner_s_per_token"] = (tot("score_s") + tot("update_s")) / max(tokens, 1)
    if "decode_ms_per_step" in timed[0]:
        out["decode_ms_per_step"] = statistics.median(r["decode_ms_per_step"] for r in timed)
        out["compiles_after_warmup"] = sum(r["compiles"] for r in timed)
        out["padding_fraction"] = statistics.mean(r["padding_fraction"] for r in timed)
    if padded and "padded_score_s" in timed[0]:
        learner = tot("score_s") + tot("update_s")
        ref = tot("padded_score_s") + tot("padded_update_s") - tot("padded_compile_s")
        out["padded_learner_s_per_token"] = ref / max(tokens, 1)
        out["padded_score_s_per_token"] = tot("padded_score_s") / max(tokens, 1)
        out["padded_update_s_per_token"] = tot("padded_update_s") / max(tokens, 1)
        out["learner_speedup"] = ref / max(learner, 1e-9)
        out["padded_compiles"] = sum(r["padded_compiles"] for r in timed)
    return out


def best_precisions(report: dict) -> dict:
    """Per regime: each arm at its best compute dtype (fewest seconds per response token) and ours
    over TRL's there."""
    out = {}
    for regime in next(iter(report["by_dtype"].values())):
        best = {}
        for arm in ("ours", "trl"):
            per = {d: r[regime][arm]["summary"]["iteration_s_per_token"] for d, r in report["by_dtype"].items()}
            dtype = min(per, key=per.get)
            best[arm] = {"dtype": dtype, "iteration_s_per_token": per[dtype]}
        best["ratio"] = best["ours"]["iteration_s_per_token"] / best["trl"]["iteration_s_per_token"]
        out[regime] = best
    return out


def markdown(report: dict) -> str:
    dtypes = report["compute_dtypes"]
    lines = [
        "# GRPO on SmolLM2-135M-Instruct: our Trainer vs TRL's GRPOTrainer (one CPU core each)",
        "",
        f"`{report['command']}`",
        "",
        report["machine"],
        "",
        "Compute dtype(s): "
        + ", ".join(dtypes)
        + " (bfloat16: bfloat16 compute over float32 master weights on both sides).",
        "",
        *_host_memory_lines(report),
    ]
    for dtype, regimes in report["by_dtype"].items():
        lines += _dtype_lines(dtype, regimes)
    if len(dtypes) > 1:
        lines += ["## Each at its best precision", ""]
        for regime, b in report["best"].items():
            lines.append(
                f"- {regime}: ours in {b['ours']['dtype']} / TRL in {b['trl']['dtype']}, seconds per response "
                f"token: **{b['ratio']:.2f}x** ({b['ours']['iteration_s_per_token']:.4f} / "
                f"{b['trl']['iteration_s_per_token']:.4f})."
            )
        lines.append("")
    lines += ["Per-iteration seconds of every arm and the resolved config are in the JSON next to this file."]
    return "\n".join(lines)


def _host_memory_lines(report: dict) -> list[str]:
    """Each arm's malloc as its process set it (reports from before the setting have none)."""
    arms = next(iter(next(iter(report["by_dtype"].values())).values()))
    if "host_memory" not in arms["ours"]:
        return []
    ours, trl = arms["ours"]["host_memory"], arms["trl"]["host_memory"]
    return [f"Host memory: ours (train.host_memory) {ours}; TRL (--trl-host-memory) {trl}.", ""]


def _dtype_lines(dtype: str, regimes: dict) -> list[str]:
    lines = []
    for regime, arms in regimes.items():
        ours, trl = arms["ours"]["summary"], arms["trl"]["summary"]
        lines += [
            f"## {dtype} compute, {regime} response lengths",
            "",
            "| arm | timed iterations | mean response tokens | rollout s/token | scoring s/token | "
            "update s/token | other s/token | iteration s/token | iteration s |",
            "|---|---|---|---|---|---|---|---|---|",
        ]
        for name, s in (("TRL GRPOTrainer", trl), ("ours (Trainer)", ours)):
            lines.append(
                f"| {name} | {s['iterations']} | {s['length_mean']:.1f} | "
                + " | ".join(f"{s[f'{p}_s_per_token']:.4f}" for p in (*PHASES, "iteration"))
                + f" | {s['iteration_s']:.1f} |"
            )
        if "padded_learner_s_per_token" in ours:
            lines.append(
                f"| ours, padded learner (before) | {ours['iterations']} | {ours['length_mean']:.1f} | - | "
                f"{ours['padded_score_s_per_token']:.4f} | {ours['padded_update_s_per_token']:.4f} | - | - | - |"
            )
        ratio = ours["iteration_s_per_token"] / trl["iteration_s_per_token"]
        lines += [
            "",
            f"Ours / TRL seconds per response token: **{ratio:.2f}x** (iteration); "
            f"rollout {ours['rollout_s_per_token'] / trl['rollout_s_per_token']:.2f}x, scoring + update "
            f"{ours['learner_s_per_token'] / max(trl['score_s_per_token'] + trl['update_s_per_token'], 1e-12):.2f}x.",
        ]
        if "learner_speedup" in ours:
            lines.append(
                f"Our learner (scoring + update) on the same batches: **{ours['learner_speedup']:.2f}x** the "
                f"padded learner's tokens/s (padding {100 * ours['padding_fraction']:.0f}% of the positions "
                f"the learner runs; compiles after warm-up: ours {ours['compiles_after_warmup']}, padded "
                f"{ours['padded_compiles']}, its compile time subtracted)."
            )
        g = arms["ours"]["generate_reference"]
        lines.append(
            f"Decode: {ours['decode_ms_per_step']:.0f} ms per step in training (median, prefill included) vs "
            f"{g['ms_per_step']:.0f} ms per step for `generate` outside training ({g['rows']} rows, "
            f"{g['steps']} new tokens, same sampling)."
        )
        lines.append("")
    return lines


def machine() -> str:
    return (
        f"{datetime.datetime.now(datetime.timezone.utc).isoformat(timespec='seconds')}; "
        f"{figprov.cpu_model()} ({os.cpu_count()} CPUs); python {platform.python_version()}; portable CPU "
        f"numerics {'on' if workers.portable_cpu_enabled() else 'off'}; commit {figprov.commit() or 'unknown'}"
    )


def main(argv=None) -> dict:
    # the host's fastest code in the arms' processes, as a user runs it (unless set otherwise)
    with workers.env_defaults(SPARSERL_PORTABLE_CPU="0"):
        return _main(parse_args(argv), argv)


def _main(args, argv) -> dict:
    cores = workers.available_cores()
    report = {
        "command": "python "
        + " ".join([os.path.relpath(__file__, REPO), *(argv if argv is not None else sys.argv[1:])]),
        "machine": machine(),
        "compute_dtypes": list(args.compute_dtypes),
        "by_dtype": {},
    }
    for dtype in args.compute_dtypes:
        run = argparse.Namespace(**{**vars(args), "compute_dtype": dtype})
        regimes = report["by_dtype"][dtype] = {}
        for regime in args.regimes:
            jobs = [(run, regime, "ours"), (run, regime, "trl")]
            results = workers.parallel_map(run_arm, jobs, cores=cores[:2])
            regimes[regime] = {
                res["arm"]: {**res, "summary": summarise(res["iterations"], padded=res["arm"] == "ours")}
                for res in results
            }
    report["best"] = best_precisions(report)
    md = markdown(report)
    figprov.write_report(args.out, report, md)
    print(md)
    return report


if __name__ == "__main__":
    main()
