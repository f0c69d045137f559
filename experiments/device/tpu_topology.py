"""TPU topologies that libtpu compiles for on a CPU machine (requirements-tpu.txt): a topology's
name as jax.experimental.topologies takes it ("v5e:2x4": generation and chip grid), its chips, its
Cloud TPU accelerator type and each chip's HBM; and the environment libtpu reads before it
starts. Nothing runs on a TPU: the devices it hands out are compile targets. Imports no JAX (a
script sets the environment before JAX starts).
"""

from __future__ import annotations

import dataclasses
import math
import os
import re


@dataclasses.dataclass(frozen=True)
class Generation:
    """A TPU generation: its Cloud accelerator-type prefix, TensorCores per chip (the type's
    number counts cores: v5p-16 is 8 chips) and HBM per chip (data sheet, GiB; XLA keeps a little
    of it: it reports 15.75 of v5e's 16)."""

    accelerator: str
    cores_per_chip: int
    hbm_gib: float


GENERATIONS = {
    "v4": Generation("v4", 2, 32.0),
    "v5e": Generation("v5litepod", 1, 16.0),
    "v5p": Generation("v5p", 2, 95.0),
    "v6e": Generation("v6e", 1, 32.0),
}
# The table's topologies: 8 chips each, the 8-device mesh overlay's size (v5p:2x2x1, Cloud's v5p-8,
# is 4 chips; tpu_compile.py scales an overlay to it).
DEFAULT_TOPOLOGIES = ("v5e:2x4", "v5p:2x2x2")


@dataclasses.dataclass(frozen=True)
class Topology:
    """One topology: its name (jax.experimental.topologies' "v5e:2x4"), generation and chip grid."""

    name: str
    generation: str
    grid: tuple[int, ...]

    @property
    def chips(self) -> int:
        return math.prod(self.grid)

    @property
    def accelerator_type(self) -> str:
        """Cloud TPU's name for the slice (TPU_ACCELERATOR_TYPE), e.g. v5litepod-8, v5p-16."""
        g = GENERATIONS[self.generation]
        return f"{g.accelerator}-{self.chips * g.cores_per_chip}"

    @property
    def hbm_gib(self) -> float:
        return GENERATIONS[self.generation].hbm_gib

    @property
    def label(self) -> str:
        return f"{self.name} ({self.accelerator_type}, {self.chips} chips)"


def parse(name: str) -> Topology:
    """A topology from its name, `<generation>:<grid>` (e.g. v5e:2x4, v5p:2x2x2)."""
    m = re.fullmatch(r"(v\d+[a-z]?):(\d+(?:x\d+)+)", name)
    if not m or m.group(1) not in GENERATIONS:
        raise ValueError(
            f"--topologies {name!r}: expected <generation>:<grid> with a generation of {sorted(GENERATIONS)} "
            "and a chip grid such as 2x4 or 2x2x2 (e.g. v5e:2x4, v5p:2x2x2)"
        )
    return Topology(name, m.group(1), tuple(int(d) for d in m.group(2).split("x")))


def environment(topology: Topology) -> dict[str, str]:
    """What libtpu and JAX read when they start, for compiling on this CPU: JAX's own backend on
    the CPU (the TPU devices come from the topology, not from a local chip), the slice's type and
    this host as its only worker, no metadata-server queries (there is none off Cloud), and no
    hold on libtpu's lockfile (/tmp/libtpu_lockfile, which guards a local chip: without a chip,
    several processes may compile at once)."""
    return {
        "JAX_PLATFORMS": "cpu",
        "ALLOW_MULTIPLE_LIBTPU_LOAD": "1",
        "TPU_ACCELERATOR_TYPE": topology.accelerator_type,
        "TPU_WORKER_HOSTNAMES": "localhost",
        "TPU_SKIP_MDS_QUERY": "1",
    }


def set_environment(topology: Topology) -> None:
    """environment(topology) into os.environ, a value already set winning; before JAX starts."""
    for key, value in environment(topology).items():
        os.environ.setdefault(key, value)


def libtpu_version() -> str | None:
    """The installed libtpu's version, None where it is not installed."""
    from importlib import metadata

    try:
        return metadata.version("libtpu")
    except metadata.PackageNotFoundError:
        return None
