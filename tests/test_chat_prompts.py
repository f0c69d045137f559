"""data.chat_template: null (default) templates jsonl datasets and leaves task prompts plain; true
templates task prompts too (rollouts, evaluation and SFT demonstrations alike); a tokenizer without
a template is refused naming the setting; evaluate --chat / --no-chat set it."""

from __future__ import annotations

import json

import numpy as np
import pytest

from sparserl_jax import components, evaluate, sft
from sparserl_jax.config import load_config
from sparserl_jax.data.tasks import get_task
from sparserl_jax.tokenizer import CharTokenizer

TASK = ["data.task=arithmetic", "data.max_prompt_len=64"]


def _no_template_tokenizer():
    tok = CharTokenizer()
    tok.chat_template = None
    tok.source = "a folder without chat_template"
    return tok


def _dataset(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text(json.dumps({"question": "1+1?", "answer": "2"}) + "\n")
    return ["data.task=null", f"data.dataset={path}", "data.prompt_template={question}"]


def test_setting_parses_null_true_false():
    assert load_config([], TASK).data.chat_template is None
    assert load_config([], [*TASK, "data.chat_template=true"]).data.chat_template is True
    assert load_config([], [*TASK, "data.chat_template=no"]).data.chat_template is False
    assert load_config([], [*TASK, "data.chat_template=null"]).data.chat_template is None


def test_task_prompts_are_plain_by_default_and_templated_with_true():
    tok = CharTokenizer()
    plain = components.prompt_source(load_config([], TASK), tok, batch_size=3).next_batch()
    chat = components.prompt_source(load_config([], [*TASK, "data.chat_template=true"]), tok, batch_size=3).next_batch()
    for p, c in zip(plain, chat, strict=True):  # the same questions (same seed), wrapped or not
        assert not p.prompt.startswith("<bos>")
        assert c.prompt == tok.apply_chat_template([{"role": "user", "content": p.prompt}])
        assert c.prompt.endswith("<|assistant|>") and list(c.prompt_ids) == tok.encode(c.prompt)
    evals = components.eval_examples(load_config([], [*TASK, "data.chat_template=true"]), tok, n=2)
    assert all(e.prompt.startswith("<bos><|user|>") for e in evals)


def test_dataset_prompts_follow_the_setting(tmp_path):
    tok = CharTokenizer()
    default = components.eval_examples(load_config([], _dataset(tmp_path)), tok, n=None)
    off = components.eval_examples(load_config([], [*_dataset(tmp_path), "data.chat_template=false"]), tok, n=None)
    assert default[0].prompt == "<bos><|user|>1+1?\n<|assistant|>" and off[0].prompt == "1+1?"


@pytest.mark.parametrize("setting,data", [("data.chat_template=true", TASK), (None, None)])
def test_tokenizer_without_template_is_refused_naming_the_setting(tmp_path, setting, data):
    overrides = [*(data or _dataset(tmp_path)), *([setting] if setting else [])]
    cfg = load_config([], overrides)
    with pytest.raises(
        ValueError,
        match=r"data.chat_template=(true|null).*has no chat template.*"
        r"data.chat_template=false",
    ):
        components.prompt_source(cfg, _no_template_tokenizer(), batch_size=1)
    plain = load_config([], [*overrides, "data.chat_template=false"])
    assert components.prompt_source(plain, _no_template_tokenizer(), batch_size=1).next_batch()


def test_sft_demonstrations_see_the_rendered_prompt():
    tok = CharTokenizer()
    cfg = load_config([], [*TASK, "data.chat_template=true"])
    task = get_task("arithmetic")
    render = components.render_prompt(cfg, tok)
    tokens, mask = sft.demonstration_batch(task, tok, np.random.default_rng(0), 2, 96, render=render)
    ((prompt, _),) = task.sample(np.random.default_rng(0), 1)
    p = tok.encode(tok.apply_chat_template([{"role": "user", "content": prompt}]))
    assert tokens[0, : len(p)].tolist() == p
    assert not mask[0, : len(p) - 1].any() and mask[0, len(p) - 1]  # loss on the response only
    plain, _ = sft.demonstration_batch(
        task, tok, np.random.default_rng(0), 2, 96, render=components.render_prompt(load_config([], TASK), tok)
    )
    assert plain[0, : len(tok.encode(prompt))].tolist() == tok.encode(prompt)


def test_evaluate_chat_flags(tmp_path):
    pytest.importorskip("transformers")
    from hf_fixtures import make_tiny_hf_checkpoint

    ckpt = make_tiny_hf_checkpoint("qwen2", tmp_path)
    CharTokenizer().save(ckpt)
    base = [
        "--checkpoint",
        str(ckpt),
        "--task",
        "arithmetic",
        "--n",
        "2",
        "--max-new-tokens",
        "2",
        "--temperature",
        "0",
        "--max-prompt-len",
        "64",
    ]
    args = evaluate.build_parser().parse_args([*base, "--chat"])
    cfg, parts = evaluate._load_policy(args)
    assert cfg.data.chat_template is True
    examples = components.eval_examples(cfg, parts.tokenizer, n=2)
    assert all(e.prompt.startswith("<bos><|user|>") for e in examples)
    cfg, _ = evaluate._load_policy(evaluate.build_parser().parse_args(base))
    assert cfg.data.chat_template is None
    with pytest.raises(ValueError, match="--chat and --no-chat"):
        evaluate._load_policy(evaluate.build_parser().parse_args([*base, "--chat", "--no-chat"]))
