"""The registry of behaviour-policy corrections: name -> Correction, in the order they are
registered, and the check of the corrections a run names.

Each correction registers itself where it is defined (`CORRECTION = register(Correction(...))`);
importing `sparserl_jax.rl.corrections` imports every shipped one. RLConfig (rl/config.py) checks
its mode against it, so no correction module imports the config.
"""

from __future__ import annotations

from sparserl_jax.registry import Registry
from sparserl_jax.rl.corrections.base import Correction

CORRECTIONS: Registry[str, Correction] = Registry("correction")
register = CORRECTIONS.register


def register_each(sources: dict[type, tuple[str, str, str]], **hooks) -> list[Correction]:
    """A family of corrections sharing their hooks, one per settings class (named by its
    SECTION): settings class -> (source, formula, frameworks), in registration order."""
    return [
        register(
            Correction(
                name=settings.SECTION, settings=settings, source=source, formula=formula, frameworks=frameworks, **hooks
            )
        )
        for settings, (source, formula, frameworks) in sources.items()
    ]


def check_combination(setting: str, names: tuple[str, ...]) -> None:
    """The corrections a run applies: registered, and at most one of them weights tokens."""
    unknown = [n for n in names if n not in CORRECTIONS]
    if unknown:
        raise ValueError(
            f"{setting} names unregistered correction(s) {', '.join(unknown)}; registered: {', '.join(CORRECTIONS)}"
        )
    weighting = [n for n in names if CORRECTIONS[n].weight is not None]
    if len(weighting) > 1:
        raise ValueError(
            f"{setting} weights tokens by {' and '.join(weighting)}: a run applies at most one weighting correction"
        )
