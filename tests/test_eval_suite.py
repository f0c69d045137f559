"""Evaluation suites (sparserl_jax/eval_suite.py, `python -m sparserl_jax.evaluate --suite`): a
malformed suite file is an error naming the file and the field; planted samples give the
hand-computed pass@1, pass@k, maj@k (a tie) and avg@k; the table is written as json, markdown,
samples and TensorBoard scalars; and the command runs a two-benchmark suite of tiny jsonl files on
a tiny HF checkpoint, dense and with a sparse KV cache, printing every score per benchmark."""

from __future__ import annotations

import json

import pytest
from tensorboard.backend.event_processing.event_file_loader import EventFileLoader
from tensorboard.util import tensor_util

from sparserl_jax import cli, eval_suite, evaluate
from sparserl_jax.tokenizer import CharTokenizer

QUESTIONS = [("1+1?", "2"), ("2+2?", "4"), ("3+4?", "7")]


def _jsonl(path, rows=QUESTIONS):
    path.write_text("".join(json.dumps({"question": q, "answer": a}) + "\n" for q, a in rows))
    return path


def _suite(tmp_path, text: str, name: str = "suite.yaml"):
    _jsonl(tmp_path / "a.jsonl")
    _jsonl(tmp_path / "b.jsonl")
    path = tmp_path / name
    path.write_text(text)
    return path


GOOD = """
name: tiny
benchmarks:
  - {name: arith, path: a.jsonl, k: 2, temperature: 1.0, max_new_tokens: 4, answer_format: boxed, reward: boxed_exact}
  - {name: arith-gsm8k, path: b.jsonl, k: 3, n: 2, temperature: 0.7, top_p: 0.9, max_new_tokens: 3,
     answer_format: gsm8k, reward: math}
"""


def test_load_resolves_paths_and_defaults(tmp_path):
    suite = eval_suite.load_suite(str(_suite(tmp_path, GOOD)))
    assert suite.name == "tiny" and [b.name for b in suite.benchmarks] == ["arith", "arith-gsm8k"]
    assert suite.benchmarks[0].path == str(tmp_path / "a.jsonl")  # relative to the suite's folder
    assert suite.benchmarks[0].top_p is None  # left out: the command's flag
    filled = suite.resolved(k=1, n=None, temperature=0.8, top_p=0.95, max_new_tokens=16, reward="math")
    assert (filled.benchmarks[0].top_p, filled.benchmarks[0].k, filled.benchmarks[1].top_p) == (0.95, 2, 0.9)
    unnamed = eval_suite.load_suite(str(_suite(tmp_path, "benchmarks: [{name: a, path: a.jsonl}]", "mine.yaml")))
    assert unnamed.name == "mine"


BENCH = "benchmarks:\n  - {name: a, path: a.jsonl, %s}\n"


@pytest.mark.parametrize(
    "text,match",
    [
        (BENCH % "k: 0", r"benchmarks\[0\]\.k=0 must be >= 1"),
        (BENCH % "k: two", r"benchmarks\[0\]\.k='two': expected an integer"),
        (BENCH % "kk: 2", r"benchmarks\[0\]\.kk: unknown setting; accepted: \[.*'k'"),
        (BENCH % "top_p: 0", r"benchmarks\[0\]\.top_p=0\.0 must be in \(0\.0, 1\.0\]"),
        (BENCH % "temperature: -1", r"benchmarks\[0\]\.temperature=-1\.0 must be >= 0"),
        (BENCH % "answer_format: latex", r"benchmarks\[0\]\.answer_format='latex': accepted values are \('auto'"),
        (BENCH % "reward: nope", r"benchmarks\[0\]\.reward='nope': accepted values"),
        (BENCH % "prompt_template: Solve", r"benchmarks\[0\]\.prompt_template='Solve' must contain"),
        ("benchmarks: [{name: a b, path: a.jsonl}]", r"benchmarks\[0\]\.name='a b': use letters"),
        ("benchmarks: [{name: a}]", r"benchmarks\[0\]: .*missing 1 required .*'path'"),
        ("benchmarks: [{name: a, path: a.jsonl}, {name: a, path: b.jsonl}]", r"benchmarks\[1\]\.name='a'.*twice"),
        ("benchmarks: {name: a, path: a.jsonl}", r"benchmarks=.*expected a list of Benchmark values"),
        ("name: empty\n", r"benchmarks: the suite lists no benchmark"),
        ("benchmark: []\n", r"benchmark: unknown setting; accepted: \['benchmarks', 'name'\]"),
        ("benchmarks: [\n", r"not valid YAML"),
    ],
)
def test_malformed_suite_names_the_field(tmp_path, text, match):
    path = _suite(tmp_path, text)
    with pytest.raises(ValueError, match=match) as e:
        eval_suite.load_suite(str(path))
    assert str(e.value).startswith(f"--suite {path}: ")


def test_missing_files_are_named(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"--suite .*nowhere\.yaml: no such file"):
        eval_suite.load_suite(str(tmp_path / "nowhere.yaml"))
    path = _suite(tmp_path, BENCH.replace("a.jsonl", "gone.jsonl") % "k: 1")
    with pytest.raises(FileNotFoundError, match=r"benchmarks\[0\]\.path='gone\.jsonl': no such file"):
        eval_suite.load_suite(str(path))


def _result(label_responses_rewards):
    samples = [
        {"source": "x", "label": label, "response": resp, "reward": r, "length": 5}
        for label, resp, r in label_responses_rewards
    ]
    return {"samples": samples, "mean_length": 5.0, "kv_saving": 0.25}


# (label, response, reward): 2 prompts x k=4
PLANTED = {
    "boxed": [
        ("4", "so \\boxed{4}", 1.0),
        ("4", "\\boxed{5}", 0.0),
        ("4", "\\boxed{ 5 }", 0.0),  # the same answer once normalised: "5" has 2 votes, "4" 2
        ("4", "\\boxed{4}.", 1.0),  # a tie: "4" came first, so the vote is right
        ("10", "\\boxed{7}", 0.0),
        ("10", "no answer", 0.0),  # casts no vote
        ("10", "\\boxed{10}", 1.0),
        ("10", "\\boxed{7}", 0.0),  # "7" wins 2 to 1: wrong
    ],
    "gsm8k": [
        ("1000", "#### 1,000", 1.0),
        ("1000", "#### 999", 0.0),
        ("1000", "\\boxed{999}", 0.0),  # no "####": no vote in this format
        ("1000", "#### 1000", 1.0),  # "1000" 2 votes (1,000 normalised), "999" 1
    ],
}


def test_scores_of_planted_samples(tmp_path):
    suite = eval_suite.Suite(
        "planted",
        (
            eval_suite.Benchmark("boxed", "x", k=4, answer_format="boxed", reward="boxed_exact"),
            eval_suite.Benchmark("gsm8k", "y", k=4, answer_format="gsm8k", reward="math"),
        ),
    )
    lines = []
    rows, samples = eval_suite.run_suite(suite, lambda b: _result(PLANTED[b.name]), log=lines.append)
    boxed, gsm8k = rows
    # prompt 0: c=2 of 4 (pass@1 .5), vote right; prompt 1: c=1 (pass@1 .25), vote wrong
    assert boxed["pass@1"] == pytest.approx(0.375) and boxed["pass@k"] == 1.0
    assert boxed["maj@k"] == 0.5 and boxed["avg@k"] == pytest.approx(0.375)
    assert boxed["no_answer"] == 1 / 8 and boxed["n_prompts"] == 2 and boxed["kv_saving"] == 0.25
    assert (gsm8k["pass@1"], gsm8k["pass@k"], gsm8k["maj@k"], gsm8k["no_answer"]) == (0.5, 1.0, 1.0, 0.25)
    assert lines[0].startswith("boxed: pass@1 = 0.3750  pass@4 = 1.0000  maj@4 = 0.5000  avg@4 = 0.3750")
    voted = [s["response"] for s in samples if s["voted"]]
    assert voted == ["so \\boxed{4}", "\\boxed{7}", "#### 1,000"]
    assert [s["answer"] for s in samples[:3]] == ["4", "5", "5"] and samples[5]["answer"] is None

    table = {"suite": "planted", "checkpoint": "ckpt", "step": 7, "kv": {"policy": "none"}, "benchmarks": rows}
    written = eval_suite.write_table(str(tmp_path / "out"), table, samples)
    assert json.loads((tmp_path / "out" / "table.json").read_text())["benchmarks"] == rows
    md = (tmp_path / "out" / "table.md").read_text()
    assert md.startswith("# planted: ckpt, step 7, KV cache dense\n")
    assert "| benchmark | k | prompts | pass@1 | pass@k | maj@k | avg@k |" in md
    assert "| boxed | 4 | 2 | 0.3750 | 1.0000 | 0.5000 | 0.3750 | 12.5% |" in md
    assert len((tmp_path / "out" / "samples.jsonl").read_text().splitlines()) == 12
    (events,) = (tmp_path / "out" / "tensorboard").glob("events.out.tfevents.*")
    (event,) = [e for e in EventFileLoader(str(events)).Load() if e.HasField("summary")]
    tags = {v.tag: float(tensor_util.make_ndarray(v.tensor)) for v in event.summary.value}
    assert event.step == 7 and tags["boxed/maj@4"] == 0.5 and tags["gsm8k/pass@1"] == 0.5
    assert {"boxed/pass@1", "boxed/pass@4", "boxed/avg@4", "gsm8k/maj@4"} <= set(tags)
    assert str(tmp_path / "out" / "table.md") in written


def test_samples_not_k_per_prompt_are_refused():
    bench = eval_suite.Benchmark("b", "x", k=3, reward="math")
    with pytest.raises(ValueError, match="4 samples are not k=3 per prompt"):
        eval_suite.score(bench, _result(PLANTED["gsm8k"]))


# ----------------------------------------------------------------------------- the command


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    pytest.importorskip("transformers")
    from hf_fixtures import make_tiny_hf_checkpoint

    d = make_tiny_hf_checkpoint("qwen2", tmp_path_factory.mktemp("hf"))
    CharTokenizer().save(d)
    return d


@pytest.mark.parametrize(
    "kv", [[], ["--kv-policy", "snapkv", "--kv-budget", "16", "--kv-buffer", "4", "--kv-compress-prompt"]]
)
def test_suite_command_prints_and_writes_the_table(tmp_path, hf_dir, capsys, kv):
    suite = _suite(tmp_path, GOOD)
    out = tmp_path / "table"
    argv = ["--checkpoint", str(hf_dir), "--suite", str(suite), "--out", str(out), "--max-prompt-len", "96", *kv]
    table = evaluate.main(argv)
    printed = capsys.readouterr().out
    for name, k in (("arith", 2), ("arith-gsm8k", 3)):
        line = next(x for x in printed.splitlines() if x.startswith(f"{name}: "))
        for score in ("pass@1", f"pass@{k}", f"maj@{k}", f"avg@{k}"):
            assert f" {score} = " in line, line
    assert "| benchmark | k | prompts | pass@1 | pass@k | maj@k | avg@k |" in printed
    saved = json.loads((out / "table.json").read_text())
    assert saved == json.loads(json.dumps(table))
    arith, gsm8k = saved["benchmarks"]
    assert (arith["k"], arith["n_prompts"], arith["temperature"], arith["top_p"]) == (2, 3, 1.0, 0.95)
    assert (gsm8k["k"], gsm8k["n_prompts"], gsm8k["top_p"], gsm8k["max_new_tokens"]) == (3, 2, 0.9, 3)
    assert (gsm8k["answer_format"], gsm8k["reward"]) == ("gsm8k", "math")
    assert len((out / "samples.jsonl").read_text().splitlines()) == 3 * 2 + 2 * 3
    assert saved["kv"]["policy"] == ("snapkv" if kv else "none")
    assert (arith["kv_saving"] > 0) == bool(kv)
    assert ("KV cache snapkv (budget 16" if kv else "KV cache dense") in (out / "table.md").read_text()
    assert list((out / "tensorboard").glob("events.out.tfevents.*"))


def test_suite_command_refuses_bad_input_in_one_line(tmp_path, hf_dir, capsys):
    suite = _suite(tmp_path, BENCH % "k: 0")
    for extra, message in (
        ([], r"benchmarks[0].k=0 must be >= 1"),
        (["--dataset", str(tmp_path / "a.jsonl")], "--suite names its own benchmarks"),
    ):
        argv = ["--checkpoint", str(hf_dir), "--suite", str(suite), *extra]
        with pytest.raises(SystemExit) as e:
            cli.run(lambda argv=argv: evaluate.main(argv))
        err = capsys.readouterr().err.strip()
        assert e.value.code == 2 and message in err and len(err.splitlines()) == 1, err


def test_an_evaluation_error_names_the_benchmark():
    suite = eval_suite.Suite("s", (eval_suite.Benchmark("long", "x", k=1, reward="math"),))

    def refuse(bench):
        raise ValueError("--max-new-tokens=8192 plus the longest prompt is beyond the model's maximum")

    with pytest.raises(ValueError, match=r"^suite 's' benchmarks\[0\] \(long\): --max-new-tokens=8192"):
        eval_suite.run_suite(suite, refuse)
