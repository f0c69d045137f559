"""Tests of sparserl_jax/data/datasets.py (jsonl prompts, iterators) and data/tasks/ (synthetic tasks)."""

import json
import logging
import re

import numpy as np
import pytest

from sparserl_jax.data import datasets as D
from sparserl_jax.data.tasks import TASKS, get_task
from sparserl_jax.tokenizer import CharTokenizer

TOK = CharTokenizer()


def _jsonl(path, rows):
    path.write_text("\n".join(r if isinstance(r, str) else json.dumps(r) for r in rows) + "\n")
    return path


# ---------------------------------------------------------------- jsonl datasets


def test_both_formats(tmp_path):
    rows = [
        {"question": "What is 2+3?", "gt_answer": "5"},
        {"problem": "Half of 1?", "answer": "so it is \\boxed{\\frac{1}{2}}"},
        {"question": "Clips?", "answer": "48/2 = 24\n#### 72"},
        {"prompt": [{"role": "user", "content": "Sum 1 2"}], "reward_model": {"ground_truth": "3"}},
        {
            "messages": [
                {"role": "system", "content": "Sys"},
                {"role": "user", "content": "Say 7"},
                {"role": "assistant", "content": "\\boxed{7}"},
            ],
            "label": 7,
        },
    ]
    path = _jsonl(tmp_path / "train.jsonl", rows[:3] + [""] + rows[3:])  # a blank line is ignored
    ex = D.load_jsonl(path, TOK, D.DatasetConfig(max_prompt_len=200))
    assert [e.label for e in ex] == ["5", "\\frac{1}{2}", "72", "3", "7"]
    assert ex[0].prompt == TOK.apply_chat_template(
        [
            {
                "role": "user",
                "content": ("What is 2+3? Please reason step by step, and put your final answer within \\boxed{}."),
            }
        ]
    )
    assert ex[3].prompt == "<bos><|user|>Sum 1 2\n<|assistant|>"  # chat rows skip the prompt template
    assert ex[4].prompt == "<bos><|system|>Sys\n<|user|>Say 7\n<|assistant|>"  # trailing answer dropped
    assert all(list(e.prompt_ids) == TOK.encode(e.prompt) for e in ex)
    assert [e.source for e in ex] == [f"{path}:{n}" for n in (1, 2, 3, 5, 6)]

    single = _jsonl(tmp_path / "q.jsonl", rows[:1])
    plain = D.load_jsonl(single, TOK, D.DatasetConfig(chat_template=False, prompt_template="Q: {question}\nA:"))
    assert plain[0].prompt == "Q: What is 2+3?\nA:"
    sys_cfg = D.DatasetConfig(system_prompt="Think.")
    assert D.load_jsonl(single, TOK, sys_cfg)[0].prompt.startswith("<bos><|system|>Think.\n<|user|>")
    with pytest.raises(ValueError, match="chat_template=true"):
        D.load_jsonl(_jsonl(tmp_path / "m.jsonl", rows[4:]), TOK, D.DatasetConfig(chat_template=False))


@pytest.mark.parametrize(
    "rows, match",
    [
        (
            [{"question": "a", "label": "1"}, {"question": "b", "label": "2"}, {"text": "c", "label": "3"}],
            r"x\.jsonl:3: row has no question; accepted fields: prompt, question, problem, messages",
        ),
        ([{"question": "a", "label": "1"}, {"question": "b"}], r"x\.jsonl:2: row has no label; accepted"),
        ([{"question": "a", "label": "1"}, "{not json"], r"x\.jsonl:2: invalid JSON"),
        (["[1, 2]"], r"x\.jsonl:1: a row must be a JSON object"),
        ([{"messages": [{"content": "no role"}], "label": "1"}], r"x\.jsonl:1: a chat prompt must be"),
        ([{"question": "a", "label": [1]}], r"x\.jsonl:1: label must be"),
        (["", "  "], r"is empty \(no rows\)"),
    ],
)
def test_row_errors_name_the_line(tmp_path, rows, match):
    with pytest.raises(ValueError, match=match):
        D.load_jsonl(_jsonl(tmp_path / "x.jsonl", rows), TOK)


def test_missing_file_and_bad_config(tmp_path):
    with pytest.raises(FileNotFoundError, match="data.dataset="):
        D.load_jsonl(tmp_path / "absent.jsonl", TOK)
    with pytest.raises(ValueError, match=r"prompt_template=.*must contain '\{question\}'"):
        D.DatasetConfig(prompt_template="no placeholder")
    with pytest.raises(ValueError, match="on_long_prompt"):
        D.DatasetConfig(on_long_prompt="truncate")
    with pytest.raises(ValueError, match="max_prompt_len"):
        D.DatasetConfig(max_prompt_len=0)


def test_long_prompts(tmp_path, caplog):
    rows = [
        {"question": "short", "label": "1"},
        {"question": "x" * 300, "label": "2"},
        {"question": "ok", "label": "3"},
    ]
    path = _jsonl(tmp_path / "long.jsonl", rows)
    with pytest.raises(ValueError, match=r"long\.jsonl:2: prompt has \d+ tokens > data.max_prompt_len=150"):
        D.load_jsonl(path, TOK, D.DatasetConfig(max_prompt_len=150))
    with caplog.at_level(logging.WARNING):
        ex = D.load_jsonl(path, TOK, D.DatasetConfig(max_prompt_len=150, on_long_prompt="skip"))
    assert [e.label for e in ex] == ["1", "3"]
    assert "long.jsonl:2" in caplog.text
    with pytest.raises(ValueError, match="every prompt is longer"):
        D.load_jsonl(path, TOK, D.DatasetConfig(max_prompt_len=5, on_long_prompt="skip"))


# ---------------------------------------------------------------- iterators


def _examples(n):
    return [D.PromptExample(prompt=f"p{i}", prompt_ids=(i,), label=str(i), source=f"s{i}") for i in range(n)]


def _labels(batch):
    return [e.label for e in batch]


def test_iterator_epochs_are_permutations_and_deterministic():
    ex = _examples(12)
    a, b, c = (D.PromptIterator(ex, 4, seed=s) for s in (5, 5, 6))
    epochs_a = [sum((_labels(a.next_batch()) for _ in range(3)), []) for _ in range(3)]
    epochs_b = [sum((_labels(b.next_batch()) for _ in range(3)), []) for _ in range(3)]
    epochs_c = [sum((_labels(c.next_batch()) for _ in range(3)), []) for _ in range(3)]
    assert epochs_a == epochs_b
    assert epochs_a != epochs_c
    for epoch in epochs_a:
        assert sorted(epoch, key=int) == [str(i) for i in range(12)]  # every example once per epoch
    assert epochs_a[0] != epochs_a[1]  # reshuffled every epoch
    ordered = D.PromptIterator(ex, 5, shuffle=False)
    assert _labels(ordered.next_batch()) == ["0", "1", "2", "3", "4"]
    ordered.next_batch()
    assert _labels(ordered.next_batch()) == ["0", "1", "2", "3", "4"]  # remainder of 2 dropped
    assert ordered.state_dict()["epoch"] == 1


def test_iterator_resume_continues_the_same_order():
    ex = _examples(10)
    ref = D.PromptIterator(ex, 3, seed=11)
    for _ in range(4):  # crosses the first epoch boundary (3 batches per epoch)
        ref.next_batch()
    state = ref.state_dict()
    assert (state["epoch"], state["position"]) == (1, 3)
    resumed = D.PromptIterator(ex, 3, seed=11)
    resumed.load_state_dict(json.loads(json.dumps(state)))  # survives a JSON round trip
    assert [_labels(resumed.next_batch()) for _ in range(7)] == [_labels(ref.next_batch()) for _ in range(7)]
    with pytest.raises(ValueError, match="num_examples=10 but this run has num_examples=9"):
        D.PromptIterator(_examples(9), 3, seed=11).load_state_dict(state)
    with pytest.raises(ValueError, match="seed=11 but this run has seed=0"):
        D.PromptIterator(ex, 3, seed=0).load_state_dict(state)
    with pytest.raises(ValueError, match=r"batch_size=11 must be in \[1, 10\]"):
        D.PromptIterator(ex, 11)


def test_task_iterator_resume():
    task = get_task("kv_recall", min_pairs=5, max_pairs=8, query_window=2)
    ref = D.TaskPromptIterator(task, 4, seed=3)
    ref.next_batch(), ref.next_batch()
    resumed = D.TaskPromptIterator(task, 4, seed=3)
    resumed.load_state_dict(ref.state_dict())
    a, b = resumed.next_batch(), ref.next_batch()
    assert [e.prompt for e in a] == [e.prompt for e in b] and len(a) == 4
    assert all(list(e.prompt_ids) == TOK.encode(e.prompt) and e.label == task.solve(e.prompt) for e in a)
    other = D.TaskPromptIterator(task, 4, seed=4)
    assert [e.prompt for e in other.next_batch()] != [
        e.prompt for e in D.TaskPromptIterator(task, 4, seed=3).next_batch()
    ]


# ---------------------------------------------------------------- synthetic tasks


@pytest.mark.parametrize("name", sorted(TASKS))
def test_task_determinism_and_rewards(name):
    task = get_task(name)
    first = task.sample(np.random.default_rng(0), 16)
    assert first == task.sample(np.random.default_rng(0), 16)
    assert first != task.sample(np.random.default_rng(1), 16)
    assert len({p for p, _ in first}) > 1
    for prompt, label in first:
        assert task.solve(prompt) == label
        ideal = task.demonstration(prompt)
        assert task.reward(ideal, label) == 1.0
        wrong = label[:-1] + ("0" if label[-1] != "0" else "1")
        assert task.reward(ideal.replace("\\boxed{" + label, "\\boxed{" + wrong), label) == 0.0
        assert task.reward(ideal.replace("\\boxed", "boxed"), label) == 0.0  # no boxed answer
        assert task.tokenizer().decode(task.tokenizer().encode(prompt + ideal)) == prompt + ideal  # in-alphabet


def test_arithmetic_task():
    task = get_task("arithmetic", min_value=10, max_value=20, n_terms=3, ops="+-")
    for prompt, label in task.sample(np.random.default_rng(7), 50):
        terms = [int(t) for t in re.findall(r"[+-]?\d+", prompt)]
        assert len(terms) == 3 and all(10 <= abs(t) <= 20 for t in terms)
        assert int(label) == sum(terms)
    assert task.demonstration("Compute 12-15+10.\n") == "12-15+10=7\n\\boxed{7}"


def test_kv_recall_answer_lives_early_in_the_prompt():
    task = get_task("kv_recall", min_pairs=30, max_pairs=30, query_window=2)
    for prompt, label in task.sample(np.random.default_rng(5), 20):
        lines = prompt.split("\n")
        key = re.search(r"Value of ([a-z]+)\?", prompt).group(1)
        where = [i for i, line in enumerate(lines) if line.startswith(key + ":")]
        assert len(where) == 1 and where[0] in (1, 2)  # one of the first query_window pairs
        assert len(prompt) - prompt.index(lines[where[0]]) > 9 * 28  # far from the question
        # The answer changes with the early pair and not with the late ones.
        changed = prompt.replace(f"{key}:{label}", f"{key}:{str((int(label) + 1) % 10**4).zfill(4)}")
        assert task.solve(changed) != label
        late = lines[-3]  # the last pair before the question
        assert task.solve(prompt.replace(late, late.split(":")[0] + ":0000")) == label
        truncated = "\n".join(lines[:1] + lines[3:])  # evict the first two pairs
        with pytest.raises(ValueError, match="not a kv_recall prompt"):
            task.solve(truncated)


@pytest.mark.parametrize(
    "name, options, lo, hi",
    [
        ("kv_recall", {}, 100, 400),
        ("kv_recall", {"min_pairs": 20, "max_pairs": 20}, 21 + 9 * 20, 21 + 9 * 20),
        ("copy_digits", {}, 100, 400),
        ("copy_digits", {"min_filler": 50, "max_filler": 50}, 8 + 50 + 28, 8 + 50 + 29),
        ("arithmetic", {}, 10, 20),
        ("cycle_walk", {}, 17, 18),
        ("cycle_walk", {"min_steps": 30, "max_steps": 40, "recall": 3}, 26, 26),
    ],
)
def test_prompt_lengths_in_tokens(name, options, lo, hi):
    task = get_task(name, **options)
    lengths = [len(TOK.encode(p)) for p, _ in task.sample(np.random.default_rng(2), 100)]
    assert lo <= min(lengths) and max(lengths) <= hi
    if lo < hi and name != "arithmetic":
        assert max(lengths) - min(lengths) > (hi - lo) // 2  # the range is actually used


def test_copy_digits_needs_the_start():
    task = get_task("copy_digits", n_digits=6)
    prompt, label = task.sample(np.random.default_rng(9), 1)[0]
    assert prompt.startswith(f"Digits: {label}\n") and prompt.count(label) == 1
    assert not re.search(r"\d", prompt[len("Digits: ") + 6 :])  # the filler has no digits
    assert task.demonstration(prompt) == f"\\boxed{{{label}}}"


def test_cycle_walk_writes_every_step_and_the_answer_needs_only_the_box():
    task = get_task("cycle_walk", nodes="bdac", min_steps=3, max_steps=12)
    for prompt, label in task.sample(np.random.default_rng(int(np.random.default_rng().integers(1 << 30))), 20):
        start, steps = re.match(r"From ([a-z]), (\d+) steps:\n$", prompt).groups()
        lines = task.demonstration(prompt).split("\n")
        assert len(lines) == int(steps) + 1 and lines[-1] == f"\\boxed{{{label}}}"
        walk = [start] + [line.split(" ")[1] for line in lines[:-1]]
        assert [line[:2] for line in lines[:-1]] == [f"{i:02d}" for i in range(1, int(steps) + 1)]
        assert all(task.nodes[(task.nodes.index(a) + 1) % 4] == b for a, b in zip(walk, walk[1:]))
        assert label == walk[-1]
        # the reward reads the final answer only: a wrong scratchpad with the right box scores 1
        assert task.reward("01 z\n\\boxed{" + label + "}", label) == 1.0
    with pytest.raises(ValueError, match="not a cycle_walk prompt"):
        task.solve("From z, 3 steps:\n")  # z is not a node of the cycle


@pytest.mark.parametrize(
    "response", ["\\boxed{}", "\\boxed{gd", "gd", "\\boxed{g}", "\\boxed{dg}", "\\boxed{gdd}", "boxed{gd}", ""]
)
def test_cycle_walk_malformed_answers_score_zero(response):
    task = get_task("cycle_walk", recall=2, min_steps=4, max_steps=6)
    assert task.reward(response, "gd") == 0.0
    assert task.reward("\\boxed{gd}", "gd") == 1.0


@pytest.mark.parametrize("numbering", ["up", "down"])
def test_cycle_walk_recall_asks_an_early_step_written_by_the_model(numbering):
    task = get_task("cycle_walk", min_steps=24, max_steps=40, recall=3, numbering=numbering)
    for prompt, label in task.sample(np.random.default_rng(int(np.random.default_rng().integers(1 << 30))), 50):
        steps, ask = map(int, re.match(r"From [a-z], (\d+) steps, ask (\d\d):\n$", prompt).groups())
        q = ask if numbering == "up" else steps - ask + 1  # the asked step
        walk = task.walk(prompt)
        assert 1 <= q <= 3 and label == walk[q - 1] + walk[-1]
        demo = task.demonstration(prompt)
        lines = demo.split("\n")
        labels = [int(line[:2]) for line in lines[:-1]]
        assert labels == (list(range(1, steps + 1)) if numbering == "up" else list(range(steps, 0, -1)))
        # the asked node sits >= 5 * (24 - 3) tokens before the answer, and not in the prompt
        assert demo.index(f"{ask:02d} {walk[q - 1]}\n") + 5 * 21 <= demo.index("\\boxed")
        assert len(TOK.encode(prompt)) <= 26 < 5 * 24
    with pytest.raises(ValueError, match="asks for line 45 of 30"):
        task.solve("From a, 30 steps, ask 45:\n")


def test_cycle_walk_memo_is_the_models_own_choice():
    task = get_task("cycle_walk", memo=True, min_steps=8, max_steps=40, numbering="down")
    rng = np.random.default_rng(int(np.random.default_rng().integers(1 << 30)))
    prompt, label = task.sample(rng, 1)[0]
    demos = [task.demonstration(prompt, rng=rng) for _ in range(200)]
    memos = {d[1] for d in demos}
    assert len(memos) > 20 and all(d.startswith(f"#{d[1]}\n") for d in demos)  # a free choice
    assert task.demonstration(prompt) == task.demonstration(prompt)  # without rng: reproducible
    for d in demos[:20]:
        assert d.endswith(f"\\boxed{{{d[1]}{label}}}") and task.reward(d, label) == 1.0
        assert task.reward(d[3:], label) == 0.0  # no memo line
        other = "A" if d[1] != "A" else "B"
        assert task.reward(f"#{other}" + d[2:], label) == 0.0  # the answer must repeat the memo
    assert "#" not in prompt and len(TOK.encode(prompt)) < 20
    walk = task.demonstration(prompt, rng=rng).split("\n")[1:-1]
    assert [int(line[:2]) for line in walk] == list(range(len(walk), 0, -1))


def test_cycle_walk_memo_key_is_named_by_the_prompt():
    task = get_task("cycle_walk", memo=True, memo_key=True, min_steps=8, max_steps=40, numbering="down")
    rng = np.random.default_rng(int(np.random.default_rng().integers(1 << 30)))
    samples = task.sample(rng, 500)
    assert len({label[0] for _, label in samples}) > 20  # random keys: no constant memo can win
    for prompt, label in samples[:20]:
        key = prompt.split("key ")[1][0]
        demo = task.demonstration(prompt, rng=rng)
        assert demo == task.demonstration(prompt)  # the memo is the key: no free choice
        assert demo.startswith(f"#{key}\n") and demo.endswith(f"\\boxed{{{key}{task.walk(prompt)[-1]}}}")
        assert label == key + task.walk(prompt)[-1] and task.reward(demo, label) == 1.0
        assert task.reward(demo[3:], label) == 1.0  # the final answer only: the memo line is a means
        other = "A" if key != "A" else "B"
        assert task.reward(demo.replace(f"{{{key}", f"{{{other}"), label) == 0.0
        assert len(TOK.encode(prompt)) <= 25 < 5 * 8 + 3  # the prompt is shorter than any response
    with pytest.raises(ValueError, match="memo_key=true needs memo=true"):
        get_task("cycle_walk", memo_key=True)
    with pytest.raises(ValueError, match="disagree"):
        task.solve("From a, 12 steps:\n")
    with pytest.raises(ValueError, match="disagree"):
        get_task("cycle_walk", memo=True).solve("From a, 12 steps, key Q:\n")


def test_cycle_walk_long_tail_lengths():
    uniform = get_task("cycle_walk", min_steps=2, max_steps=23)
    tail = get_task("cycle_walk", min_steps=2, max_steps=23, lengths="long_tail", tail_alpha=1.0)
    rng = np.random.default_rng(int(np.random.default_rng().integers(1 << 30)))
    steps = {t: np.array([len(t.walk(p)) for p, _ in t.sample(rng, 2000)]) for t in (uniform, tail)}
    u, s = steps[uniform], steps[tail]
    assert u.min() >= 2 and u.max() <= 23 and abs(np.median(u) - 12.5) < 2
    assert s.min() >= 2 and s.max() == 23  # clipped at the cap
    assert np.median(s) <= 5 and 0.03 < np.mean(s == 23) < 0.2 and np.mean(s) > np.median(s) + 2


def test_task_registry_errors():
    with pytest.raises(
        ValueError,
        match=r"task='sudoku' is not registered; accepted: \['arithmetic', 'chat_arithmetic', 'copy_digits', 'cycle_walk', 'kv_recall'\]",
    ):
        get_task("sudoku")
    with pytest.raises(ValueError, match=r"has no option\(s\) \['pairs'\]; accepted"):
        get_task("kv_recall", pairs=3)
    with pytest.raises(ValueError, match="query_window=9 must be in"):
        get_task("kv_recall", min_pairs=5, query_window=9)
    with pytest.raises(ValueError, match=r"min_pairs, max_pairs\)=\(9, 3\)"):
        get_task("kv_recall", min_pairs=9, max_pairs=3, query_window=1)
    with pytest.raises(ValueError, match="ops="):
        get_task("arithmetic", ops="*")
    with pytest.raises(ValueError, match="n_terms"):
        get_task("arithmetic", n_terms=1)
    for options, match in [
        ({"nodes": "aab"}, "nodes='aab'"),
        ({"max_steps": 120}, "max_steps=120"),
        ({"lengths": "zipf"}, r"lengths='zipf'; accepted: \['uniform', 'long_tail'\]"),
        ({"recall": 5, "min_steps": 3}, "recall=5 must be in"),
        ({"min_steps": 9, "max_steps": 3}, r"min_steps, max_steps\)=\(9, 3\)"),
        ({"tail_alpha": 0.0}, "tail_alpha=0.0"),
        ({"numbering": "sideways"}, r"numbering='sideways'; accepted: \['up', 'down'\]"),
    ]:
        with pytest.raises(ValueError, match=match):
            get_task("cycle_walk", **options)
