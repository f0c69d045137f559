"""Which packages the wheel holds, found rather than listed so that no folder can be left out:
every package under sparserl_jax/; kernels/ with its subpackages installed as sparserl_jax.kernels
(a package called `kernels` exists on PyPI, so the folder is never imported under its own name);
experiments/ with real/ installed as sparserl_jax.experiments, so that the scripts and the tests
import the figure library and each other by that name (`python experiments/<name>.py` runs a script
of it; its results and configs stay in the checkout). Everything else about the project is in
pyproject.toml; tests/test_install.py builds the wheel and imports every module of the source
tree from it."""

from setuptools import find_packages, setup

# the folders installed under another name: package -> folder
MOVED = {"sparserl_jax.kernels": "kernels", "sparserl_jax.experiments": "experiments"}

setup(
    packages=[
        *find_packages(include=["sparserl_jax", "sparserl_jax.*"]),
        *(
            name
            for package, folder in MOVED.items()
            for name in (package, *(f"{package}.{p}" for p in find_packages(folder)))
        ),
    ],
    package_dir={"sparserl_jax": "sparserl_jax", **MOVED},
)
