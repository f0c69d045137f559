"""Which packages the wheel holds, found rather than listed so that no folder can be left out:
every package under sparserl_jax/; kernels/ with its subpackages installed as sparserl_jax.kernels
(a package called `kernels` exists on PyPI, so the folder is never imported under its own name);
experiments/ under its own name, `experiments`, so that a script, a test and a structure viewer
all read `from experiments.lib import figlib` as the file experiments/lib/figlib.py
(`python experiments/<folder>/<script>.py` runs a script; its results and configs stay in the
checkout). The figure scripts (experiments/figures/) stay out of the wheel: they read the
checkout's configs and write its results, so only a checkout runs them (an editable install
imports them from the folder). Everything else about the project is in pyproject.toml;
tests/test_install.py builds the wheel and imports every module it holds."""

from setuptools import find_packages, setup

# the folders installed under another name: package -> folder
MOVED = {"sparserl_jax.kernels": "kernels"}
CHECKOUT_ONLY = ("experiments.figures",)  # never in the wheel (see above)

setup(
    packages=[
        *find_packages(include=["sparserl_jax", "sparserl_jax.*"]),
        *(
            name
            for package, folder in MOVED.items()
            for name in (package, *(f"{package}.{p}" for p in find_packages(folder)))
        ),
        *find_packages(include=["experiments", "experiments.*"], exclude=CHECKOUT_ONLY),
    ],
    package_dir={"sparserl_jax": "sparserl_jax", "experiments": "experiments", **MOVED},
)
