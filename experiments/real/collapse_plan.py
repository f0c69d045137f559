"""The real-model collapse study's plan (Sparse-RL Table 1 / Fig. 3 on SmolLM2-135M-Instruct):
its settings, arms, seeds, horizon, rules and every run's overrides, fixed before the runs and
written into each results.md. The study itself (training, records, render) is real/collapse.py;
the device check's `study` step (device/gpu_study.py) measures the same plan's iterations on a
GPU. Imports no JAX."""

from __future__ import annotations

import dataclasses
import os

from experiments.lib import figlib

CONFIG = os.path.join(figlib.HERE, "configs", "real", "smollm2_collapse.yaml")

ITERATIONS = 20
EVAL_EVERY = 10
EVAL_PROMPTS = 128
SEEDS = (0, 1, 2)


PERSIST_K3 = 0.02  # mismatch k3 per token over a sparse run's last quarter, at least
PERSIST_QUESTION = 0.10  # fraction of the question's KV entries evicted over its last quarter, at least
RKV48Q_PLAN = f"""\
**What this setting adds, declared before its first run** (2026-11-28, issue 54; the plan above
holds unchanged: arms, seeds, horizon, evaluation, collapse rules, tie rule and verdicts, so the
settings read side by side; the untrained model and the dense arm are rkv64's runs, adopted: the
same resolved config, no eviction). Hypothesis as above: naive sparse training collapses where
the eviction persists, Sparse-RL does not and stays level with dense.
**The mismatch must persist** for this setting to answer the question. Every sparse run logs, per
iteration, mismatch k3 per token (mismatch/kl_k3) and the fraction of its question's KV entries
evicted at each response's end (question/evicted: 1 - the entries of the prompt's positions the
cache still holds, over every layer and KV head, over prompt length x layers x KV heads; the
logged KV saving alone falls as answers shorten, since the dense cache shrinks with them). A
sparse run's mismatch **persisted** when, over the last quarter of its iterations, k3 >=
{PERSIST_K3} and question/evicted >= {PERSIST_QUESTION:.2f}; otherwise it **faded**, and that run's row
says which. The verdicts state how many of the 6 sparse runs kept the mismatch; a verdict read
from runs whose mismatch faded says so. If it fades in most of them (4 or more of 6), this
setting cannot answer the question and the declared next setting runs: rkv32q, the same with
budget 32, calibrated first on the untrained model by the same targets (calibration run 13's
command at --budgets 32).
**The mechanism, beside the verdicts**: per run and iteration (rollout/question.py), how much of
the question the sampler evicted (question/evicted), how much of its numbers (question/numbers_evicted:
tokens whose text holds a digit, the operands the reward needs), the fraction of responses whose
question lost a number (question/number_lost: some number token held in at most half of its
entries at the response's end) and the mean train reward of those responses and of the rest. The
dense arm at the same seed samples the same prompts at every iteration (train.seed decides the
prompts), so its train reward is that of dense rollouts of the same prompts; results.md sets the
three side by side over the run and its last quarter."""

RKV32Q_PLAN = f"""\
**What this setting adds, declared before its first run** (2026-11-28, issue 54, after rkv48q's
12 runs: its mismatch faded in 5 of 6 sparse runs, so rkv48q's plan named this setting next). Everything
of rkv48q's plan holds unchanged (the plan above: arms, seeds, horizon, evaluation, collapse rules,
tie rule and verdicts; the persistence rule, k3 >= {PERSIST_K3} and question/evicted >=
{PERSIST_QUESTION:.2f} over each sparse run's last quarter; the mechanism table; the untrained model and the
dense arm adopted from rkv64's records), with the budget 32 instead of 48: the 57-token question is
compressed to 32 entries at prefill. Calibrated first on the untrained model by the same targets
(calibration run 14, run 13's command at --budgets 32: sampled reward 0.266 sparse vs 0.312 dense,
84% of groups mixed, KV saving 64.5%, k3 0.256, SARS 33.3% of tokens and 14.5% of responses
rejected; every target but budget > prompt, the setting's point). Hypothesis as rkv48q's. If the
mismatch fades again in 4 or more of the 6 sparse runs, no smaller budget follows on this model:
at 32 the sparse sampler's reward is already 0.85x dense's before training, and the study's
answer is then that on SmolLM2-135M and this task the policy escapes any eviction it can shorten
its way out of; the claim where it cannot (the paper's long answers) is a GPU's work."""


@dataclasses.dataclass(frozen=True)
class Setting:
    """A sparse-rollout setting: its KV overrides (shared by both sparse arms) and why it is here."""

    label: str
    kv: tuple[str, ...]
    why: str
    plan: str = ""  # what this setting's plan adds to PLAN, declared with it before its first run
    persistence: bool = False  # read and judge the mismatch's persistence (PERSISTENCE) per sparse run


DEFAULT_SETTING = "rkv64"
SETTINGS = {
    "rkv64": Setting(
        "R-KV, budget 64 + buffer 16",
        ("kv.policy=rkv", "kv.budget=64", "kv.buffer=16"),
        "the calibrated config's eviction (experiments/results/real/calibration/chat_arithmetic, "
        "the collapse study's setting): a budget above the 57-token prompt, a third of the KV saved",
    ),
    "rkv48": Setting(
        "R-KV, budget 48 + buffer 16",
        ("kv.policy=rkv", "kv.budget=48", "kv.buffer=16"),
        "run only if nothing collapses under rkv64: the larger mismatch of a budget below the prompt "
        "(the first compression evicts part of the question), calibrated the same way before it runs "
        "(every target but budget > prompt)",
    ),
    "rkv48q": Setting(
        "R-KV, budget 48 + buffer 16, the question compressed at prefill",
        ("kv.policy=rkv", "kv.budget=48", "kv.buffer=16", "kv.compress_prompt=true", "rollout.question_kv=true"),
        "a setting without the escape of rkv64 and rkv48 (answers too short to compress): with "
        "kv.compress_prompt=true the 57-token question is squeezed into the budget before the first "
        "token, so every response, however short, decodes over a compressed question; calibrated on the "
        "untrained model before any of its runs (calibration run 13: every target but budget > prompt, "
        "the setting's point)",
        plan=RKV48Q_PLAN,
        persistence=True,
    ),
    "rkv32q": Setting(
        "R-KV, budget 32 + buffer 16, the question compressed at prefill",
        ("kv.policy=rkv", "kv.budget=32", "kv.buffer=16", "kv.compress_prompt=true", "rollout.question_kv=true"),
        "rkv48q's declared next setting (its mismatch faded in 5 of 6 sparse runs): the 57-token "
        "question squeezed into 32 entries before the first token; calibrated on the untrained model "
        "before any of its runs (calibration run 14: every target but budget > prompt)",
        plan=RKV32Q_PLAN,
        persistence=True,
    ),
}
ARMS = {  # name -> (rl.mode, sparse rollouts?, label)
    "dense": ("dense", False, "dense rollouts"),
    "naive": ("naive_sparse", True, "sparse, no correction"),
    "sparse_rl": ("sparse_rl", True, "sparse + Sparse-RL"),
}
HORIZON_GAIN = 0.10  # held-out accuracy the dense arm is expected to gain within ITERATIONS

PLAN = f"""\
**Plan, fixed before the runs** (2026-11-26; it replaces the plan of the earlier, uncalibrated
setting, which never ran to the end). Base: experiments/configs/real/smollm2_collapse.yaml, calibrated
on the untrained model before any RL run against targets written down first
(experiments/results/real/calibration/chat_arithmetic/results.md, "The collapse study's setting"):
sums of two numbers 1-9 in SmolLM2's chat template ("Think step by step. At the end, write "The
answer is" and the number."; the reward reads a \\boxed{{}}, else the answer line, else the last
number), 4 prompts x 8 samples an iteration at temperature 0.6, up to 192 new tokens, lr 1e-5,
beta 1e-4, one optimizer step an iteration. Arms: dense rollouts (rl.mode=dense), sparse rollouts
trained as if on-policy (naive_sparse) and sparse rollouts with Sparse-RL (sparse_rl: SARS + IBR at
the authors' settings), the two sparse arms under the setting's KV eviction. Seeds {list(SEEDS)} per arm
(train.seed: prompts, sampling). {ITERATIONS} iterations a run.
Horizon: the dense arm is expected to gain at least {HORIZON_GAIN:.2f} of held-out accuracy (about 2 SE of a
difference of two {EVAL_PROMPTS}-prompt evaluations) within {ITERATIONS} iterations, on the mean over seeds;
if it does not, no verdict on collapse is stated (a model that does not learn can show neither
collapse nor stability) and the next study doubles the horizon.
Evaluation: held-out accuracy (greedy decoding on {EVAL_PROMPTS} prompts never trained on, the same
prompts at every point of a seed) under dense inference (the policy itself), at iterations 0 (the
untrained model, per seed), {EVAL_EVERY} and {ITERATIONS}; a difference of two evaluations has SE
sqrt(p1 (1 - p1) / n + p2 (1 - p2) / n) (figlib.diff_se).
Collapse rule (one for every arm): a run has collapsed when its final held-out accuracy is below half
of the untrained model's at its seed (figlib.collapsed with the untrained model as the warm start);
the train-reward rule (figlib.reward_collapse_iteration: the 5-iteration moving average of the train
reward below half its first value) is reported beside it for every run; the accuracy rule leads.
Hypothesis (the paper's claim): naive sparse training collapses while dense does not, and Sparse-RL
does not collapse and stays level with dense.
Verdicts (only when every planned run is recorded): the collapse claim is **supported** if the naive
arm collapses at every seed and dense at none, **refuted** (in this setting and budget) if the naive
arm collapses at no seed while its final accuracy ties dense by the tie rule (every seed's
difference within 2 SE of that difference), **open** otherwise (k of n seeds, or no collapse but a
clear drop). Sparse-RL's claim is **supported** if it collapses at no seed and ties or beats dense at
every seed, **not supported** if it collapses at any seed or is behind dense by the tie rule. If
nothing collapses under rkv64, the same study runs under rkv48 (the larger mismatch), and each
setting gets its own verdict."""

SMOKE_KV = ("kv.budget=16", "kv.buffer=4")  # --smoke: a cache that evicts within 16 new tokens


def overrides(setting: Setting, arm: str, seed: int, smoke: bool = False) -> list[str]:
    mode, sparse, _ = ARMS[arm]
    kv = [*setting.kv, *(SMOKE_KV if smoke else ())] if sparse else ["kv.policy=none"]
    return [f"rl.mode={mode}", *kv, f"train.seed={seed}"]


def untrained(seed: int) -> list[str]:
    return ["rl.mode=dense", "kv.policy=none", f"train.seed={seed}", "train.iterations=0"]


def plan(seeds, setting: Setting, smoke: bool = False) -> list[tuple[str, list[str]]]:
    """Every planned run as (name, overrides), in the order they start: the untrained model's
    evaluation per seed, then per seed dense, naive, Sparse-RL (dense seed 0 first: the horizon
    check reads it)."""
    return [(f"untrained/seed{s}", untrained(s)) for s in seeds] + [
        (f"{arm}/seed{s}", overrides(setting, arm, s, smoke)) for s in seeds for arm in ARMS
    ]


def plan_counts(seeds: int, iterations: int) -> tuple[int, int]:
    """(training runs, evaluations) of a setting's plan: every arm at every seed, the untrained
    model's evaluation per seed and each run's every EVAL_EVERY iterations."""
    return len(ARMS) * seeds, seeds * (1 + len(ARMS) * (iterations // EVAL_EVERY))
