"""Tokenizers: one protocol, one implementation on top of the `tokenizers` package.

`HFTokenizer` reads a Hugging Face tokenizer folder (tokenizer.json + tokenizer_config.json, with
the chat template rendered in a sandboxed jinja2 environment the way transformers renders it).
`CharTokenizer` is the same class built in memory over a fixed character alphabet (vocab 103) for
the synthetic tasks; it saves to a folder that `HFTokenizer.from_dir` (and transformers) can load,
so both go through one code path.
"""

from __future__ import annotations

import json
import os
import string
from collections.abc import Sequence
from datetime import datetime
from functools import cached_property
from typing import Any, Protocol, runtime_checkable

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.utils
import numpy as np
from jaxtyping import Bool
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import AddedToken, decoders, models
from tokenizers import Tokenizer as _RustTokenizer

# Named special tokens that transformers passes to chat templates (its SPECIAL_TOKENS_ATTRIBUTES).
SPECIAL_TOKEN_NAMES: tuple[str, ...] = (
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
)


@runtime_checkable
class Tokenizer(Protocol):
    """What the sampler, datasets and tasks need from a tokenizer."""

    vocab_size: int
    eos_token_ids: tuple[int, ...]  # any of them ends a response
    pad_token_id: int
    bos_token_id: int | None
    newline_token_ids: frozenset[int]  # tokens whose text contains a line break (KV newline trigger)

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int], skip_special: bool = True) -> str: ...

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True) -> str: ...

    def is_newline(self, token_id: int) -> bool: ...


# --------------------------------------------------------------------------- chat templates


class _GenerationTag(jinja2.ext.Extension):
    """Accepts the `{% generation %}...{% endgeneration %}` blocks of HF templates; renders the body."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

    def _render(self, caller) -> str:
        return caller()


class _TemplateNamespace(jinja2.utils.Namespace):
    """jinja2 `namespace` that refuses underscore attributes (no route to interpreter internals)."""

    def __init__(*args, **kwargs):
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _TemplateNamespace._check(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name, value):
        _TemplateNamespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name):
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"chat template namespace attribute {name!r} starts with '_'")


class _TemplateDict:
    """The `dict` global of templates: builds plain dicts, exposes nothing else."""

    def __call__(self, *args, **kwargs):
        return dict(*args, **kwargs)

    def fromkeys(self, *args, **kwargs):
        return dict.fromkeys(*args, **kwargs)


def _raise_exception(message: str):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
    # Like transformers: plain json.dumps, no HTML escaping (jinja2's own tojson escapes < > &).
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def compile_chat_template(source: str) -> jinja2.Template:
    """Compiles an (untrusted) HF chat template in an immutable sandbox with transformers' settings."""
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    env.globals["dict"] = _TemplateDict()
    env.globals["namespace"] = _TemplateNamespace
    return env.from_string(source)


def _plain(value: Any) -> Any:
    """Copies message data into plain JSON types so a template cannot reach methods of rich objects."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    raise TypeError(f"chat messages must hold JSON-like data (str, numbers, lists, dicts); got {type(value).__name__}")


# --------------------------------------------------------------------------- HF folders


def _read_json(path: str) -> dict | None:
    if not os.path.isfile(path):
        return None
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def _token_str(value: Any) -> str | None:
    """A special token in tokenizer_config.json: a string, an AddedToken dict or null."""
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None


def _as_id_list(value: Any) -> list[int]:
    if value is None:
        return []
    return [int(v) for v in value] if isinstance(value, (list, tuple)) else [int(value)]


def _pick_chat_template(value: Any, source: str) -> str | None:
    """tokenizer_config.json's chat_template: a string, or a list of {name, template} (use "default")."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, list):
        named = {t["name"]: t["template"] for t in value}
        if "default" not in named:
            raise ValueError(f"chat_template in {source} has no 'default' entry; names: {sorted(named)}")
        return named["default"]
    raise ValueError(f"chat_template in {source} must be a string or a list of {{name, template}}")


class HFTokenizer:
    """A `tokenizers.Tokenizer` plus the special-token ids and chat template from the config files."""

    def __init__(
        self,
        tokenizer: _RustTokenizer,
        *,
        eos_token_ids: Sequence[int],
        pad_token_id: int | None = None,
        bos_token_id: int | None = None,
        chat_template: str | None = None,
        special_tokens: dict[str, str] | None = None,
        source: str = "<in memory>",
    ):
        if not eos_token_ids:
            raise ValueError(f"tokenizer from {source}: eos_token_ids must name at least one token")
        self._tok = tokenizer
        self.vocab_size: int = tokenizer.get_vocab_size(with_added_tokens=True)
        self.eos_token_ids: tuple[int, ...] = tuple(dict.fromkeys(int(i) for i in eos_token_ids))
        self.pad_token_id: int = self.eos_token_ids[0] if pad_token_id is None else int(pad_token_id)
        self.bos_token_id: int | None = bos_token_id
        self.chat_template: str | None = chat_template
        self.special_tokens: dict[str, str] = dict(special_tokens or {})
        self.source = source
        for name, tid in (("eos", self.eos_token_ids), ("pad", (self.pad_token_id,)), ("bos", (bos_token_id,))):
            for i in tid:
                if i is not None and not 0 <= i < self.vocab_size:
                    raise ValueError(f"tokenizer from {source}: {name} token id {i} outside [0, {self.vocab_size})")
        self._compiled: jinja2.Template | None = None

    # ---- loading and saving

    @classmethod
    def from_dir(cls, path: str | os.PathLike) -> HFTokenizer:
        """Loads tokenizer.json + tokenizer_config.json (+ generation_config.json, config.json if present)."""
        path = os.fspath(path)
        tok_file = os.path.join(path, "tokenizer.json")
        if not os.path.isfile(tok_file):
            raise FileNotFoundError(f"tokenizer.json not found in {path!r} (a Hugging Face tokenizer folder needs it)")
        tok = _RustTokenizer.from_file(tok_file)
        cfg_file = os.path.join(path, "tokenizer_config.json")
        tcfg = _read_json(cfg_file)
        if tcfg is None:
            raise FileNotFoundError(f"tokenizer_config.json not found in {path!r} (needed for special tokens)")
        gen = _read_json(os.path.join(path, "generation_config.json")) or {}
        mcfg = _read_json(os.path.join(path, "config.json")) or {}

        def tid(name: str) -> int | None:
            s = _token_str(tcfg.get(name))
            if s is None:
                return None
            i = tok.token_to_id(s)
            if i is None:
                raise ValueError(f"{name}={s!r} in {cfg_file} is not in the vocabulary of {tok_file}")
            return i

        eos = [i for i in [tid("eos_token")] if i is not None]
        eos += _as_id_list(gen.get("eos_token_id")) + _as_id_list(mcfg.get("eos_token_id"))
        if not eos:
            raise ValueError(
                f"no end-of-sequence token in {path!r}: set eos_token in tokenizer_config.json or "
                "eos_token_id in generation_config.json / config.json"
            )
        pad = tid("pad_token")
        if pad is None:
            pad = next(iter(_as_id_list(gen.get("pad_token_id")) + _as_id_list(mcfg.get("pad_token_id"))), None)
        template = _pick_chat_template(tcfg.get("chat_template"), cfg_file)
        jinja_file = os.path.join(path, "chat_template.jinja")
        if os.path.isfile(jinja_file):  # transformers >= 4.43 saves the template here
            with open(jinja_file, encoding="utf-8") as f:
                template = f.read()
        elif template is None:
            extra = _read_json(os.path.join(path, "chat_template.json")) or {}
            template = _pick_chat_template(extra.get("chat_template"), "chat_template.json")
        specials = {n: s for n in SPECIAL_TOKEN_NAMES if (s := _token_str(tcfg.get(n))) is not None}
        return cls(
            tok,
            eos_token_ids=eos,
            pad_token_id=pad,
            bos_token_id=tid("bos_token"),
            chat_template=template,
            special_tokens=specials,
            source=path,
        )

    def save(self, path: str | os.PathLike) -> None:
        """Writes tokenizer.json and tokenizer_config.json (loadable by from_dir and by transformers).

        Extra end-of-sequence ids beyond eos_token go to generation_config.json (merged into an existing one).
        """
        path = os.fspath(path)
        os.makedirs(path, exist_ok=True)
        self._tok.save(os.path.join(path, "tokenizer.json"))
        specials = dict(self.special_tokens)
        specials.setdefault("eos_token", self._tok.id_to_token(self.eos_token_ids[0]))
        specials.setdefault("pad_token", self._tok.id_to_token(self.pad_token_id))
        if self.bos_token_id is not None:
            specials.setdefault("bos_token", self._tok.id_to_token(self.bos_token_id))
        cfg = {"tokenizer_class": "PreTrainedTokenizerFast", **specials}
        if self.chat_template is not None:
            cfg["chat_template"] = self.chat_template
        with open(os.path.join(path, "tokenizer_config.json"), "w", encoding="utf-8") as f:
            json.dump(cfg, f, indent=2, ensure_ascii=False)
        if len(self.eos_token_ids) > 1:
            gen_file = os.path.join(path, "generation_config.json")
            gen = _read_json(gen_file) or {}
            gen["eos_token_id"] = list(self.eos_token_ids)
            with open(gen_file, "w", encoding="utf-8") as f:
                json.dump(gen, f, indent=2)

    # ---- text <-> ids

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Token ids of `text`. Special-token strings in the text (e.g. from a chat template) map to
        their ids; `add_special_tokens` applies the tokenizer's post-processor (e.g. a BOS prefix)."""
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def encode_batch(self, texts: Sequence[str], add_special_tokens: bool = False) -> list[list[int]]:
        return [e.ids for e in self._tok.encode_batch(list(texts), add_special_tokens=add_special_tokens)]

    def decode(self, ids: Sequence[int], skip_special: bool = True) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=skip_special)

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    # ---- chat template

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True) -> str:
        """Renders `messages` ([{"role", "content"}, ...]) as transformers' apply_chat_template(tokenize=False)."""
        if self.chat_template is None:
            raise ValueError(
                f"tokenizer from {self.source} has no chat template (tokenizer_config.json 'chat_template' or "
                "chat_template.jinja); drop --chat (generate), pass --no-chat (evaluate) or set data.chat_template=false (train)"
            )
        if self._compiled is None:
            self._compiled = compile_chat_template(self.chat_template)
        for m in messages:
            if not isinstance(m, dict):
                raise TypeError(f"chat messages must be dicts with 'role' and 'content'; got {m!r}")
        return self._compiled.render(
            messages=_plain(messages),
            tools=None,
            documents=None,
            add_generation_prompt=add_generation_prompt,
            **self.special_tokens,
        )

    # ---- line breaks (trigger of newline-based KV compression)

    @cached_property
    def newline_token_ids(self) -> frozenset[int]:
        texts = self._tok.decode_batch([[i] for i in range(self.vocab_size)], skip_special_tokens=False)
        return frozenset(i for i, t in enumerate(texts) if "\n" in t)

    def is_newline(self, token_id: int) -> bool:
        return int(token_id) in self.newline_token_ids

    def newline_mask(self) -> Bool[np.ndarray, " V"]:
        """[V] bool mask of newline tokens, for use inside jitted decode loops."""
        mask_V = np.zeros(self.vocab_size, dtype=bool)
        mask_V[list(self.newline_token_ids)] = True
        return mask_V


# --------------------------------------------------------------------------- char tokenizer

CHAR_SPECIAL_TOKENS: tuple[str, ...] = (
    "<pad>",
    "<bos>",
    "<eos>",
    "<unk>",
    "<|system|>",
    "<|user|>",
    "<|assistant|>",
)
CHAR_ALPHABET: str = string.digits + string.ascii_letters + string.punctuation + " \n"

# Each message is "<|role|>content\n"; assistant messages end with <eos>.
CHAR_CHAT_TEMPLATE: str = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('unknown role ' + message['role'] + '; accepted: system, user, assistant') }}"
    "{% endif %}"
    "{{ '<|' + message['role'] + '|>' + message['content'] }}"
    "{% if message['role'] == 'assistant' %}{{ eos_token }}{% else %}{{ '\\n' }}{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}"
)


class CharTokenizer(HFTokenizer):
    """One token per character of CHAR_ALPHABET (digits, letters, punctuation, space, newline) plus
    special tokens: vocab 103, for tiny models on the synthetic tasks. Unknown characters map to <unk>.

    Built as a `tokenizers` BPE model with no merges, so `save()` writes a standard tokenizer.json.
    """

    def __init__(self):
        vocab = {t: i for i, t in enumerate(CHAR_SPECIAL_TOKENS + tuple(CHAR_ALPHABET))}
        tok = _RustTokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
        tok.decoder = decoders.Fuse()
        tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in CHAR_SPECIAL_TOKENS])
        super().__init__(
            tok,
            eos_token_ids=(vocab["<eos>"],),
            pad_token_id=vocab["<pad>"],
            bos_token_id=vocab["<bos>"],
            chat_template=CHAR_CHAT_TEMPLATE,
            special_tokens={"bos_token": "<bos>", "eos_token": "<eos>", "unk_token": "<unk>", "pad_token": "<pad>"},
            source="CharTokenizer",
        )


def load_tokenizer(spec: str) -> HFTokenizer:
    """ "char" -> CharTokenizer(); anything else is a Hugging Face tokenizer folder."""
    if spec == "char":
        return CharTokenizer()
    if not os.path.isdir(spec):
        raise FileNotFoundError(f"tokenizer={spec!r} must be 'char' or a folder with tokenizer.json")
    return HFTokenizer.from_dir(spec)
