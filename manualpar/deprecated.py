"""Every deprecated spelling in one place: what it was, what replaces it, and a warning.

Old spellings keep working (user code is written against them) and warn once per call site
with the new one, so a search for a name finds its whole deprecation here.
"""

from __future__ import annotations

import warnings

__all__ = ["DEPRECATED", "normalize_by", "warn_deprecated"]

# old spelling -> (new spelling, the version that renamed it)
DEPRECATED = {
    'normalize_by="world"': ('normalize_by="world_size"', "0.2"),
    "FusedOptimizer.optimizer": ("FusedOptimizer.rule", "0.2"),
}


def warn_deprecated(old: str, stacklevel: int = 3) -> None:
    """A FutureWarning (shown to users by default) naming `old`'s replacement."""
    new, since = DEPRECATED[old]
    warnings.warn(
        f"{old} was renamed {new} in manualpar {since}; the old spelling still works but "
        "will be removed",
        FutureWarning,
        stacklevel=stacklevel,
    )


def normalize_by(value: str) -> str:
    """A builder's `normalize_by`, with the pre-0.2 "world" read as "world_size"."""
    if value == "world":
        warn_deprecated('normalize_by="world"', stacklevel=4)
        return "world_size"
    return value
