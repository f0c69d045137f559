"""Settings as data: YAML files and `key=value` overrides -> a nested mapping -> frozen dataclasses.

The one loader of the package. It knows no schema: `from_dict(cls, tree, prefix)` builds any
dataclass field by field from its type hints (int, float, bool, str, Literal, tuple[X, ...],
X | None, mappings, nested dataclasses), so a wrong type or an unknown key fails in one line that
names the setting. Values are only coerced here; each config class checks its own ranges in
__post_init__ (with sparserl_jax.validate). sparserl_jax.config holds the run's schema and
load_config / dump_config for it.
"""

from __future__ import annotations

import collections.abc
import dataclasses
import re
import types
import typing
from collections.abc import Mapping, Sequence
from typing import Any

import yaml


def _unwrap_optional(tp):
    """X | None -> (X, True); any other type -> (tp, False)."""
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) == 1:
            return args[0], True
    return tp, False


_TRUE = ("true", "yes", "on", "1")
_FALSE = ("false", "no", "off", "0")


class Raw(str):
    """A `key=value` override's value as typed: coerced from its text by the field's type (so a
    string field keeps `1e-6` or `007` verbatim and a number field reads `1e-6` as a float)."""


def coerce(value: Any, tp: Any, name: str) -> Any:
    """`value` (a YAML value, or a Raw override string) as field type `tp`: int, float, bool, str,
    Literal, tuple[X, ...], X | None, a mapping or a nested dataclass. A value that does not fit
    raises ValueError naming the setting `name`, its value and the expected type."""
    tp, optional = _unwrap_optional(tp)
    if isinstance(value, Raw):
        if tp is Any:
            return yaml.safe_load(value)
        if optional and value.strip() in ("null", "None", "~", ""):
            return None
        if tp is str:
            return str(value)
        if typing.get_origin(tp) is typing.Literal:
            value = str(value)
        elif typing.get_origin(tp) is tuple:  # YAML's [1, 2], else "1,2", "7" or "" as typed
            loaded = yaml.safe_load(value)
            value = loaded if isinstance(loaded, list) else str(value)
        else:
            value = yaml.safe_load(value)
    if value is None:
        if optional or tp is Any:
            return None
        raise ValueError(f"{name}: null is not accepted (expected {_type_name(tp)})")
    if dataclasses.is_dataclass(tp):
        return from_dict(tp, value, name)
    origin = typing.get_origin(tp)

    def bad():
        return ValueError(f"{name}={value!r}: expected {_type_name(tp)}")

    if tp is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.strip().lower() in _TRUE + _FALSE:
            return value.strip().lower() in _TRUE
        raise bad()
    if tp is int:
        if isinstance(value, bool):
            raise bad()
        if isinstance(value, int):
            return value
        try:
            f = float(value) if isinstance(value, (str, float)) else None
        except ValueError:
            raise bad() from None
        if f is None or not f.is_integer():
            raise bad()
        return int(f)
    if tp is float:
        if isinstance(value, bool):
            raise bad()
        try:
            return float(value)
        except (TypeError, ValueError):
            raise bad() from None
    if tp is str:
        if isinstance(value, str):
            return value
        raise bad()
    if origin is typing.Literal:
        if value in typing.get_args(tp):
            return value
        raise ValueError(f"{name}={value!r}: expected one of {typing.get_args(tp)}")
    if origin is tuple:
        if isinstance(value, str):  # "1,2,3" as well as YAML's [1, 2, 3]
            value = [v.strip() for v in value.replace("[", "").replace("]", "").split(",") if v.strip()]
        if not isinstance(value, (list, tuple)):
            raise bad()
        args = typing.get_args(tp)
        if len(args) == 2 and args[1] is Ellipsis:
            return tuple(coerce(v, args[0], f"{name}[{i}]") for i, v in enumerate(value))
        if len(args) != len(value):
            raise bad()
        return tuple(coerce(v, a, f"{name}[{i}]") for i, (v, a) in enumerate(zip(value, args)))
    if origin in (Mapping, dict, collections.abc.Mapping):
        if isinstance(value, Mapping):
            return {k: coerce(v, Any, f"{name}.{k}") for k, v in value.items()}
        raise bad()
    return value


def _type_name(tp) -> str:
    if typing.get_origin(tp) is tuple:
        return "a list of " + _type_name(typing.get_args(tp)[0]) + " values"
    if typing.get_origin(tp) in (Mapping, dict, collections.abc.Mapping):
        return "a mapping"
    names = {int: "an integer", float: "a number", bool: "true or false", str: "a string"}
    return names.get(tp, getattr(tp, "__name__", str(tp)))


def from_dict(cls, d: Mapping[str, Any], prefix: str):
    """Build dataclass `cls` from a nested mapping, every value coerced to its field's type;
    unknown keys and values of the wrong type raise naming the setting."""
    if not isinstance(d, Mapping):
        raise ValueError(f"{prefix}: expected a mapping of settings, got {d!r}")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    kwargs = {}
    for key, value in d.items():
        name = f"{prefix}.{key}" if prefix else key
        if key not in fields:
            raise ValueError(f"{name}: unknown setting; accepted: {sorted(fields)}")
        kwargs[key] = coerce(value, hints[key], name)
    try:
        return cls(**kwargs)
    except TypeError as e:
        raise ValueError(f"{prefix or 'config'}: {e}") from None
    except ValueError as e:
        raise ValueError(named_under(str(e), prefix, tuple(fields))) from None


def named_under(message: str, prefix: str, fields: tuple[str, ...]) -> str:
    """A dataclass's own checks name its settings by its usual section (ModelConfig's `model.`);
    built under another one (`model.arch`), the message names them there: `model.family=` ->
    `model.arch.family=`."""
    if not prefix or not fields:
        return message
    pattern = re.compile(r"(?<![\w.])((?:\w+\.)+)(" + "|".join(map(re.escape, fields)) + r")(?==)")
    return pattern.sub(lambda m: m.group(0) if m.group(1) == prefix + "." else f"{prefix}.{m.group(2)}", message)


def to_dict(cfg) -> dict:
    """A config as plain nested dicts (what from_dict reads back)."""
    return dataclasses.asdict(cfg)


def _set_dotted(tree: dict, dotted: str, value: Any) -> None:
    keys = dotted.split(".")
    node = tree
    for k in keys[:-1]:
        node = node.setdefault(k, {})
        if not isinstance(node, dict):
            raise ValueError(f"override {dotted}: {k} is not a section")
    node[keys[-1]] = value


def read_tree(paths: Sequence[str] = (), overrides: Sequence[str] = ()) -> dict:
    """YAML files merged in order (a later file's sections merge into an earlier one's), then
    `key=value` overrides as Raw strings that from_dict coerces by each field's type (so
    `rl.optim.lr=1e-6` is the float 1e-6 and a string field keeps `007` as typed)."""
    tree: dict = {}
    for path in paths:
        try:
            with open(path) as f:
                loaded = yaml.safe_load(f) or {}
        except FileNotFoundError:
            raise FileNotFoundError(f"--config {path}: no such file") from None
        _deep_merge(tree, loaded, path)
    for item in overrides:
        if "=" not in item:
            raise ValueError(f"override {item!r}: expected key=value, e.g. kv.budget=256")
        key, raw = item.split("=", 1)
        _set_dotted(tree, key.strip(), Raw(raw))
    return tree


def _deep_merge(into: dict, new: Mapping, where: str) -> None:
    if not isinstance(new, Mapping):
        raise ValueError(f"{where}: the top level must be a mapping of sections")
    for k, v in new.items():
        if isinstance(v, Mapping) and isinstance(into.get(k), dict):
            _deep_merge(into[k], v, where)
        else:
            into[k] = dict(v) if isinstance(v, Mapping) else v
