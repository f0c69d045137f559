"""The one config loader (sparserl_jax/config_io.py): YAML files and key=value overrides -> a tree
-> any config dataclass, with unknown keys and wrong types named; and the schema (config.py)
round-tripping through it. The bad-input table of the CLIs is in test_reliability.py."""

import ast
from pathlib import Path

import pytest

from sparserl_jax import config as run_config
from sparserl_jax.config import TrainConfig, dump_config, load_config
from sparserl_jax.config_io import Raw, coerce, from_dict, read_tree, to_dict
from sparserl_jax.kvcache.config import KVConfig
from sparserl_jax.rl import config as rl_config

PKG = Path(__file__).resolve().parent.parent / "sparserl_jax"


def test_from_dict_builds_any_section_with_its_prefix():
    """What RLConfig.from_dict did, through the one loader: nested sections, defaults kept."""
    cfg = from_dict(
        rl_config.RLConfig, {"mode": "qurl", "acr": {"c": "3"}, "loss": {"aggregation": "token_mean"}}, "rl"
    )
    assert cfg.acr.c == 3.0 and type(cfg.acr.c) is float
    assert cfg.loss.aggregation == "token_mean" and cfg.sars == rl_config.SarsConfig()
    assert from_dict(KVConfig, {"policy": "rkv", "newline_token_ids": [1, 2]}, "kv").newline_token_ids == (1, 2)


@pytest.mark.parametrize(
    "cls, tree, prefix, message",
    [
        (
            rl_config.RLConfig,
            {"sars": {"lo": 0.1}},
            "rl",
            "rl.sars.lo: unknown setting; accepted: ['token_hi', 'token_level', 'token_lo', 'token_rule', "
            "'veto', 'veto_level', 'veto_threshold']",
        ),
        (rl_config.RLConfig, {"sars": 3}, "rl", "rl.sars: expected a mapping of settings, got 3"),
        (KVConfig, {"budget": "many"}, "kv", "kv.budget='many': expected an integer"),
        (KVConfig, {"budget": 2.5}, "kv", "kv.budget=2.5: expected an integer"),
        (KVConfig, {"compress_prompt": "maybe"}, "kv", "kv.compress_prompt='maybe': expected true or false"),
        (KVConfig, {"budget": None}, "kv", "kv.budget: null is not accepted (expected an integer)"),
        (KVConfig, {"budget": 0}, "kv", "kv.budget=0 must be >= 1"),  # the section's own range check
        (TrainConfig, {"rollout": {"prompts": "x"}}, "", "rollout.prompts='x': expected an integer"),
    ],
)
def test_from_dict_names_the_setting(cls, tree, prefix, message):
    with pytest.raises(ValueError) as e:
        from_dict(cls, tree, prefix)
    assert str(e.value) == message


def test_coerce_reads_an_override_by_the_field_type():
    assert coerce(Raw("1e-6"), float, "x") == 1e-6
    assert coerce(Raw("007"), str, "x") == "007"  # a string field keeps what was typed
    assert coerce(Raw("1e2"), int, "x") == 100
    assert coerce(Raw("null"), int | None, "x") is None
    assert coerce(Raw("1,2"), tuple[int, ...], "x") == (1, 2)
    assert coerce(Raw("off"), bool, "x") is False


def test_read_tree_merges_files_in_order_then_overrides(tmp_path):
    a, b = tmp_path / "a.yaml", tmp_path / "b.yaml"
    a.write_text("kv:\n  policy: rkv\n  budget: 64\nrollout:\n  prompts: 4\n")
    b.write_text("kv:\n  budget: 32\n")
    tree = read_tree([str(a), str(b)], ["kv.buffer=8", "rollout.samples=2"])
    assert tree == {"kv": {"policy": "rkv", "budget": 32, "buffer": "8"}, "rollout": {"prompts": 4, "samples": "2"}}
    assert all(type(v) is Raw for v in (tree["kv"]["buffer"], tree["rollout"]["samples"]))
    with pytest.raises(ValueError, match=r"^override 'kv\.budget': expected key=value"):
        read_tree([], ["kv.budget"])
    with pytest.raises(ValueError, match=r"^override kv\.budget\.x: budget is not a section$"):
        read_tree([], ["kv.budget=1", "kv.budget.x=2"])
    with pytest.raises(FileNotFoundError, match="--config nope.yaml: no such file"):
        read_tree(["nope.yaml"])
    (tmp_path / "list.yaml").write_text("- 1\n")
    with pytest.raises(ValueError, match="the top level must be a mapping of sections"):
        read_tree([str(tmp_path / "list.yaml")])


def test_load_and_dump_round_trip(tmp_path):
    cfg = load_config(
        [],
        [
            "kv.policy=rkv",
            "kv.budget=48",
            "kv.newline_token_ids=[10]",
            "rl.mode=tis",
            "quant.format=int8",
            "quant.skip=[embed, lm_head, down]",
            "rollout.scheduler=sorted",
            "sorted.mode=partial",
            "data.task_options={max_pairs: 3}",
            "train.seed=7",
        ],
    )
    assert cfg.kv.budget == 48 and cfg.quant.skip == ("embed", "lm_head", "down")
    assert cfg.data.task_options == {"max_pairs": 3} and cfg.sorted.mode == "partial"
    dump_config(cfg, tmp_path / "c.yaml")
    assert load_config([str(tmp_path / "c.yaml")]) == cfg
    assert from_dict(TrainConfig, to_dict(cfg), "") == cfg
    assert from_dict(TrainConfig, to_dict(TrainConfig()), "") == TrainConfig()


def _package_imports(path: Path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module)
    return {m for m in found if m.split(".")[0] == "sparserl_jax"}


def test_loader_and_checks_are_leaves():
    """config_io and validate know no schema and import nothing of the package, so any section
    (kvcache, model, quant, rl, data) can use them without an import cycle."""
    assert _package_imports(PKG / "config_io.py") == set()
    assert _package_imports(PKG / "validate.py") == set()


def test_config_exports_only_its_own_names():
    """config.py is the schema: whatever it exports (its __all__, if it has one) is defined there,
    never another package's classes."""
    own = {
        n
        for n, v in vars(run_config).items()
        if not n.startswith("_") and getattr(v, "__module__", None) == "sparserl_jax.config"
    }
    assert {"TrainConfig", "DataConfig", "load_config", "dump_config"} <= own
    assert set(getattr(run_config, "__all__", own)) <= own


def test_a_nested_sections_own_checks_name_it_where_it_sits():
    """ModelConfig names its settings model.<field>; built as model.arch the error says so."""
    from sparserl_jax.config_io import named_under

    assert named_under("model.family='gpt': accepted", "model.arch", ("family",)) == "model.arch.family='gpt': accepted"
    assert named_under("kv.window=8 must be smaller than kv.budget=2", "kv", ("window", "budget")) == (
        "kv.window=8 must be smaller than kv.budget=2"
    )
    assert named_under("rollout.max_new_tokens=3 too long", "kv", ("budget",)) == "rollout.max_new_tokens=3 too long"
