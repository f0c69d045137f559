"""Parquet datasets (sparserl_jax/data/parquet.py through data/datasets.py load_dataset): verl's
layout and flat columns give the PromptExamples their jsonl twin gives, train to the same first
batch, and their errors name the file, the row and the column."""

import json
import os

import jax
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from compile_cache import compile_cache_in_process

from sparserl_jax.config import load_config
from sparserl_jax.data import datasets as D
from sparserl_jax.tokenizer import CharTokenizer
from sparserl_jax.train import Trainer

TOK = CharTokenizer()
SMOKE = os.path.join(os.path.dirname(__file__), "..", "experiments", "configs", "smoke.yaml")


def _verl_row(i: int, question: str, answer: str, source: str = "openai/gsm8k") -> dict:
    """A row as verl's examples/data_preprocess/gsm8k.py writes it."""
    return {
        "data_source": source,
        "prompt": [{"role": "user", "content": question}],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": answer},
        "extra_info": {"split": "train", "index": i, "answer": f"so {answer}\n#### {answer}", "question": question},
    }


VERL_ROWS = [
    _verl_row(0, "1+2=", "3"),
    _verl_row(1, "2+2=", "4"),
    _verl_row(2, "half of 1?", "\\frac{1}{2}", source="lighteval/MATH"),
    _verl_row(3, "4+1=", "5"),
    _verl_row(4, "A, B or C: 2>1?", "A", source="multiple_choice"),
    _verl_row(5, "3+3=", "6"),
]


def _parquet(path, rows):
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def _jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _same_examples(a: list[D.PromptExample], b: list[D.PromptExample]) -> None:
    """Equal in everything but their origin (file:line against file row)."""
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert (x.prompt, x.prompt_ids, x.label, x.data_source) == (y.prompt, y.prompt_ids, y.label, y.data_source)


def test_verl_layout_reads_as_its_jsonl_twin(tmp_path):
    cfg = D.DatasetConfig(max_prompt_len=200)
    from_parquet = D.load_dataset(_parquet(tmp_path / "train.parquet", VERL_ROWS), TOK, cfg)
    from_jsonl = D.load_dataset(_jsonl(tmp_path / "train.jsonl", VERL_ROWS), TOK, cfg)
    _same_examples(from_parquet, from_jsonl)
    assert [e.label for e in from_parquet] == ["3", "4", "\\frac{1}{2}", "5", "A", "6"]
    assert [e.data_source for e in from_parquet][:3] == ["openai/gsm8k", "openai/gsm8k", "lighteval/MATH"]
    assert from_parquet[0].prompt == "<bos><|user|>1+2=\n<|assistant|>"  # a chat row: no prompt template
    assert from_parquet[4].source == f"{tmp_path / 'train.parquet'} row 4"
    assert from_jsonl[4].source == f"{tmp_path / 'train.jsonl'}:5"


def test_flat_columns_and_a_column_mapping(tmp_path):
    flat = [{"question": "1+2=", "answer": "1+2 = 3\n#### 3"}, {"question": "2+5=", "answer": "#### 7"}]
    ex = D.load_dataset(_parquet(tmp_path / "flat.parquet", flat), TOK, D.DatasetConfig(max_prompt_len=200))
    assert [e.label for e in ex] == ["3", "7"] and [e.data_source for e in ex] == [None, None]
    _same_examples(ex, D.load_dataset(_jsonl(tmp_path / "flat.jsonl", flat), TOK, D.DatasetConfig(max_prompt_len=200)))

    mapped = [
        {"text": "2+2=", "question": "ignored", "solution": {"final": "4", "steps": "2+2"}, "origin": "gsm8k"},
        {"text": "3+2=", "question": "ignored", "solution": {"final": "5", "steps": "3+2"}, "origin": "gsm8k"},
    ]
    columns = D.DatasetColumns(question="text", label="solution.final", data_source="origin")
    cfg = D.DatasetConfig(chat_template=False, prompt_template="Q: {question}", columns=columns)
    for path in (_parquet(tmp_path / "m.parquet", mapped), _jsonl(tmp_path / "m.jsonl", mapped)):
        ex = D.load_dataset(path, TOK, cfg)
        assert [(e.prompt, e.label, e.data_source) for e in ex] == [
            ("Q: 2+2=", "4", "gsm8k"),
            ("Q: 3+2=", "5", "gsm8k"),
        ]


@pytest.mark.parametrize(
    "rows, columns, match",
    [
        # a column named by data.columns that the file lacks: the file, the setting, the columns
        (
            VERL_ROWS[:2],
            {"label": "reward_model.answer"},
            r"bad\.parquet: data\.columns\.label='reward_model\.answer' is no column of the file; its columns: "
            r"data_source, prompt, .*reward_model\.ground_truth",
        ),
        # a row without a question: the file, the row (from 0) and the columns tried
        (
            [{"question": "1+1=", "answer": "2"}, {"question": None, "answer": "3"}],
            {},
            r"bad\.parquet row 1: row has no question; accepted fields: prompt, question, problem, messages",
        ),
        # an empty value in the column data.columns names
        (
            [{"q": "1+1=", "a": "2"}, {"q": "1+2=", "a": "3"}, {"q": "", "a": "4"}],
            {"question": "q", "label": "a"},
            r"bad\.parquet row 2: column 'q' \(data\.columns\.question\) is missing or empty",
        ),
        # a chat message without content
        (
            [
                _verl_row(0, "1+1=", "2"),
                {**_verl_row(1, "x", "3"), "prompt": [{"role": "user", "content": None}]},
            ],
            {},
            r"bad\.parquet row 1: a chat prompt must be a list of \{'role', 'content'\} objects \(column 'prompt'\)",
        ),
        # a label that is a list
        (
            [{"question": "1+1=", "answer": [2]}],
            {},
            r"bad\.parquet row 0: label must be a string or a number, got list \(column 'answer'\)",
        ),
        # a data_source that is no string
        (
            [{"question": "1+1=", "answer": "2", "data_source": 7}],
            {},
            r"bad\.parquet row 0: data_source must be a string, got int \(column 'data_source'\)",
        ),
    ],
)
def test_errors_name_file_row_and_column(tmp_path, rows, columns, match):
    path = _parquet(tmp_path / "bad.parquet", rows)
    with pytest.raises(ValueError, match=match):
        D.load_dataset(path, TOK, D.DatasetConfig(max_prompt_len=200, columns=D.DatasetColumns(**columns)))


def test_unreadable_empty_and_missing_files(tmp_path):
    (tmp_path / "text.parquet").write_text("not parquet")
    with pytest.raises(ValueError, match=r"text\.parquet' is not a readable parquet file"):
        D.load_dataset(tmp_path / "text.parquet", TOK)
    empty = pa.Table.from_pylist([], schema=pa.schema([("question", pa.string()), ("answer", pa.string())]))
    pq.write_table(empty, tmp_path / "empty.parquet")
    with pytest.raises(ValueError, match=r"empty\.parquet' is empty \(no rows\)"):
        D.load_dataset(tmp_path / "empty.parquet", TOK)
    with pytest.raises(FileNotFoundError, match=r"absent\.parquet' does not exist"):
        D.load_dataset(tmp_path / "absent.parquet", TOK)


@pytest.mark.parametrize(
    "override, match",
    [
        ("data.columns.label=reward_model.", r"data\.columns\.label='reward_model\.' must be a column name"),
        ("data.columns.question=reward_model..x", r"data\.columns\.question='reward_model\.\.x' must be"),
    ],
)
def test_column_settings_are_checked(override, match):
    with pytest.raises(ValueError, match=match):
        load_config([SMOKE], ["data.task=null", "data.dataset=x.parquet", override])


def _cfg(out, dataset, *overrides):
    """smoke.yaml on a dataset: 4 prompts x 4 samples, prompts rendered in the chat template."""
    return load_config(
        [SMOKE],
        [
            f"train.out_dir={out}",
            "train.progress=false",
            "data.task=null",
            f"data.dataset={dataset}",
            "data.max_prompt_len=64",
            "train.eval_prompts=4",
            *overrides,
        ],
    )


def test_parquet_and_jsonl_train_to_the_same_first_batch(tmp_path, tmp_path_factory):
    """The acceptance test of issue 56: a verl-format parquet file and the jsonl file of the same
    rows give the same prompt batches and the same first update batch, rewards included."""
    parquet = _parquet(tmp_path / "train.parquet", VERL_ROWS)
    jsonl = _jsonl(tmp_path / "train.jsonl", VERL_ROWS)
    with compile_cache_in_process(tmp_path_factory):
        a = Trainer(_cfg(tmp_path / "a", parquet))
        b = Trainer(_cfg(tmp_path / "b", jsonl))
        _same_examples(a.prompts.examples, b.prompts.examples)
        key = jax.random.key(3)
        batch_a, metrics_a, texts_a = a.rollout_batch(key)
        batch_b, metrics_b, texts_b = b.rollout_batch(key)
    assert a.prompts.state_dict() == b.prompts.state_dict()
    assert batch_a.keys() == batch_b.keys()
    for k in batch_a:
        np.testing.assert_array_equal(batch_a[k], batch_b[k], err_msg=k)
    assert texts_a == texts_b
    untimed = lambda m: {k: v for k, v in m.items() if not k.startswith(("time/", "throughput/"))}
    assert untimed(metrics_a) == untimed(metrics_b)
    assert metrics_a["reward/timeouts"] == 0.0
