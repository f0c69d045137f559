"""Which packages the wheel holds, found rather than listed so that no folder can be left out:
every package under sparserl_jax/, and kernels/ with its subpackages installed as
sparserl_jax.kernels (a package called `kernels` exists on PyPI, so the folder is never imported
under its own name). Everything else about the project is in pyproject.toml; tests/test_install.py
builds the wheel and imports every module of the source tree from it."""

from setuptools import find_packages, setup

KERNELS = "sparserl_jax.kernels"

setup(
    packages=[
        *find_packages(include=["sparserl_jax", "sparserl_jax.*"]),
        KERNELS,
        *(f"{KERNELS}.{p}" for p in find_packages("kernels")),
    ],
    package_dir={"sparserl_jax": "sparserl_jax", KERNELS: "kernels"},
)
