"""Tests of sparserl_jax/tokenizer.py against `tokenizers` and transformers' AutoTokenizer."""

import json
import string

import jinja2
import numpy as np
import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from sparserl_jax.tokenizer import (
    CHAR_ALPHABET,
    CharTokenizer,
    HFTokenizer,
    load_tokenizer,
)
from sparserl_jax.tokenizer import (
    Tokenizer as TokenizerProtocol,
)

# A ChatML template in the style of Qwen2.5 (default system prompt, generation prompt).
CHATML = (
    "{%- if messages[0]['role'] == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}"
    "{%- else %}{{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}{%- endif %}\n"
    "{%- for message in messages %}\n"
    "  {%- if not (message.role == 'system' and loop.first) %}\n"
    "    {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}\n"
    "  {%- endif %}\n"
    "{%- endfor %}\n"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}\n"
)
# A Llama-3 style template: bos_token, namespace, loop controls, tojson, {% generation %}; block
# tags on their own indented lines (rendered with trim_blocks and lstrip_blocks, like transformers).
LLAMA_LIKE = """{{ bos_token }}{% set ns = namespace(turns=0) %}
{% for message in messages %}
    {% if message['role'] not in ['system', 'user', 'assistant'] %}
        {{ raise_exception('bad role') }}
    {% endif %}
    {% set ns.turns = ns.turns + 1 %}
    {% if message['role'] == 'assistant' %}
        {% generation %}<|start|>assistant

{{ message['content'] | trim }}<|eot|>{% endgeneration %}
    {% else %}
<|start|>{{ message['role'] }}

{{ message['content'] | trim }}<|eot|>
    {% endif %}
    {% if loop.index > 20 %}{% break %}{% endif %}
{% endfor %}
{% if add_generation_prompt %}
<|start|>assistant

{% endif %}
{{ '' if ns.turns < 100 else {'turns': ns.turns} | tojson }}"""

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|begin|>", "<|start|>", "<|eot|>"]


def _random_text(rng, n_words):
    words = ["".join(rng.choice(list(string.ascii_lowercase), size=int(rng.integers(1, 8)))) for _ in range(n_words)]
    seps = rng.choice([" ", " ", " ", "\n", ", ", ". "], size=n_words)
    return "".join(w + s for w, s in zip(words, seps))


def _build_bpe(rng) -> Tokenizer:
    """A tiny byte-level BPE trained on random text (like GPT-2 / Qwen tokenizers)."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400, special_tokens=SPECIALS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    corpus = [_random_text(rng, 40) + "1+2=3 \\boxed{12}" for _ in range(50)]
    tok.train_from_iterator(corpus, trainer=trainer)
    return tok


def _write(folder, tok, config, generation=None, jinja=None):
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    if generation is not None:
        (folder / "generation_config.json").write_text(json.dumps(generation))
    if jinja is not None:
        (folder / "chat_template.jinja").write_text(jinja)
    return folder


CONVERSATIONS = [
    [{"role": "user", "content": "What is 1+2?"}],
    [
        {"role": "system", "content": "Be terse."},
        {"role": "user", "content": "Hi\nthere"},
        {"role": "assistant", "content": "  \\boxed{3}  "},
        {"role": "user", "content": "Again?"},
    ],
]


@pytest.fixture(scope="module")
def qwen_like(tmp_path_factory):
    tok = _build_bpe(np.random.default_rng(1))
    folder = _write(
        tmp_path_factory.mktemp("qwen_like"),
        tok,
        {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "eos_token": "<|im_end|>",
            "pad_token": "<|endoftext|>",
            "bos_token": None,
            "chat_template": CHATML,
        },
        generation={"eos_token_id": [tok.token_to_id("<|im_end|>"), tok.token_to_id("<|endoftext|>")]},
    )
    return folder, tok


def test_hf_tokenizer_special_ids(qwen_like):
    folder, tok = qwen_like
    t = HFTokenizer.from_dir(folder)
    assert isinstance(t, TokenizerProtocol)
    assert t.vocab_size == tok.get_vocab_size()
    assert t.eos_token_ids == (tok.token_to_id("<|im_end|>"), tok.token_to_id("<|endoftext|>"))
    assert t.pad_token_id == tok.token_to_id("<|endoftext|>")
    assert t.bos_token_id is None


def test_hf_round_trip_and_matches_transformers(qwen_like):
    from transformers import AutoTokenizer

    folder, _ = qwen_like
    t = HFTokenizer.from_dir(folder)
    ref = AutoTokenizer.from_pretrained(str(folder))
    rng = np.random.default_rng(2)
    for _ in range(5):
        text = _random_text(rng, 30) + " \\boxed{42}\n"
        ids = t.encode(text)
        assert t.decode(ids) == text
        assert ids == ref.encode(text, add_special_tokens=False)
    chat = t.apply_chat_template(CONVERSATIONS[1])
    assert t.decode(t.encode(chat), skip_special=False) == chat
    assert "<|im_start|>" not in t.decode(t.encode(chat))  # special tokens skipped by default
    for messages in CONVERSATIONS:
        for gen in (True, False):
            ours = t.apply_chat_template(messages, add_generation_prompt=gen)
            theirs = ref.apply_chat_template(messages, tokenize=False, add_generation_prompt=gen)
            assert ours == theirs
    assert t.apply_chat_template(CONVERSATIONS[0]).startswith("<|im_start|>system\nYou are a helpful assistant.")


def test_template_features_and_jinja_file_priority(qwen_like, tmp_path):
    from transformers import AutoTokenizer

    _, tok = qwen_like
    folder = _write(
        tmp_path / "llama_like",
        tok,
        {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "eos_token": "<|eot|>",
            "bos_token": "<|begin|>",
            "chat_template": "ignored: chat_template.jinja takes priority",
        },
        jinja=LLAMA_LIKE,
    )
    t = HFTokenizer.from_dir(folder)
    ref = AutoTokenizer.from_pretrained(str(folder))
    assert t.bos_token_id == tok.token_to_id("<|begin|>")
    assert t.pad_token_id == t.eos_token_ids[0] == tok.token_to_id("<|eot|>")  # pad falls back to eos
    for messages in CONVERSATIONS:
        ours = t.apply_chat_template(messages)
        assert ours == ref.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        assert ours.startswith("<|begin|><|start|>")
    with pytest.raises(jinja2.exceptions.TemplateError, match="bad role"):
        t.apply_chat_template([{"role": "tool", "content": "x"}])


def test_sandbox_blocks_unsafe_templates(qwen_like, tmp_path):
    _, tok = qwen_like
    for i, template in enumerate(["{{ messages.append(1) }}", "{% set ns = namespace(_x=1) %}"]):
        folder = _write(tmp_path / f"bad{i}", tok, {"eos_token": "<|im_end|>", "chat_template": template})
        with pytest.raises(jinja2.exceptions.SecurityError):
            HFTokenizer.from_dir(folder).apply_chat_template(CONVERSATIONS[0])
    folder = _write(tmp_path / "dunder", tok, {"eos_token": "<|im_end|>", "chat_template": "[{{ ''.__class__ }}]"})
    assert HFTokenizer.from_dir(folder).apply_chat_template(CONVERSATIONS[0]) == "[]"


def test_missing_files_and_settings(qwen_like, tmp_path):
    _, tok = qwen_like
    with pytest.raises(FileNotFoundError, match="tokenizer.json"):
        HFTokenizer.from_dir(tmp_path)
    tok.save(str(tmp_path / "tokenizer.json"))
    with pytest.raises(FileNotFoundError, match="tokenizer_config.json"):
        HFTokenizer.from_dir(tmp_path)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": CHATML}))
    with pytest.raises(ValueError, match="eos_token"):
        HFTokenizer.from_dir(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"eos_token_id": 2, "pad_token_id": 0}))
    t = HFTokenizer.from_dir(tmp_path)  # eos from config.json
    assert t.eos_token_ids == (2,) and t.pad_token_id == 0
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|not-a-token|>"}))
    with pytest.raises(ValueError, match="not in the vocabulary"):
        HFTokenizer.from_dir(tmp_path)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|im_end|>"}))
    with pytest.raises(ValueError, match="no chat template"):
        HFTokenizer.from_dir(tmp_path).apply_chat_template(CONVERSATIONS[0])
    with pytest.raises(FileNotFoundError, match="tokenizer="):
        load_tokenizer(str(tmp_path / "nowhere"))


def test_newline_tokens(qwen_like):
    folder, _ = qwen_like
    t = HFTokenizer.from_dir(folder)
    assert t.newline_token_ids, "a byte-level BPE has at least the newline byte"
    for i in t.newline_token_ids:
        assert "\n" in t.decode([i], skip_special=False)
    ids = t.encode("ab\ncd\n\nef")
    assert [t.is_newline(i) for i in ids] == ["\n" in t.decode([i]) for i in ids]
    assert any(t.is_newline(i) for i in ids)
    mask_V = t.newline_mask()
    assert mask_V.shape == (t.vocab_size,) and mask_V.sum() == len(t.newline_token_ids)


def test_char_tokenizer(tmp_path):
    from transformers import AutoTokenizer

    c = CharTokenizer()
    assert isinstance(c, TokenizerProtocol)
    assert c.vocab_size <= 128 and c.vocab_size == len(CHAR_ALPHABET) + 7
    rng = np.random.default_rng(3)
    text = "".join(rng.choice(list(CHAR_ALPHABET), size=300))
    ids = c.encode(text)
    assert len(ids) == len(text) and c.decode(ids) == text
    assert c.encode("é") == [c.token_to_id("<unk>")]
    assert c.encode("<eos>") == list(c.eos_token_ids) and c.decode(c.eos_token_ids) == ""
    assert c.pad_token_id == 0 and c.bos_token_id == 1
    assert c.newline_token_ids == frozenset({c.token_to_id("\n")})
    chat = c.apply_chat_template(CONVERSATIONS[1])
    assert (
        chat
        == "<bos><|system|>Be terse.\n<|user|>Hi\nthere\n<|assistant|>  \\boxed{3}  <eos><|user|>Again?\n<|assistant|>"
    )
    assert c.decode(c.encode(chat), skip_special=False) == chat
    c.save(tmp_path)
    loaded = HFTokenizer.from_dir(tmp_path)
    assert loaded.encode(text) == ids and loaded.apply_chat_template(CONVERSATIONS[1]) == chat
    assert (loaded.eos_token_ids, loaded.pad_token_id, loaded.bos_token_id) == (c.eos_token_ids, 0, 1)
    ref = AutoTokenizer.from_pretrained(str(tmp_path))
    assert ref.apply_chat_template(CONVERSATIONS[1], tokenize=False, add_generation_prompt=True) == chat
    assert ref.encode(chat, add_special_tokens=False) == c.encode(chat)
    assert load_tokenizer("char").encode("ab") == c.encode("ab")


def test_save_keeps_extra_eos_ids(qwen_like, tmp_path):
    folder, _ = qwen_like
    t = HFTokenizer.from_dir(folder)
    t.save(tmp_path)
    again = HFTokenizer.from_dir(tmp_path)
    assert again.eos_token_ids == t.eos_token_ids and again.pad_token_id == t.pad_token_id
    assert again.apply_chat_template(CONVERSATIONS[1]) == t.apply_chat_template(CONVERSATIONS[1])
