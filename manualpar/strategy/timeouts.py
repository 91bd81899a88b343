"""The collective timeout: an argument, else $MANUALPAR_TIMEOUT_S, else 5 minutes.

Never torch's 30-minute default: a rank that died or stalled must stop the others in bounded
time, and the tests run every collective with a few seconds of timeout.
"""

from __future__ import annotations

import os
from datetime import timedelta

from manualpar.errors import ClusterEnvironmentError, ConfigError

__all__ = ["DEFAULT_TIMEOUT", "TIMEOUT_ENV_VAR", "resolve_timeout"]

# Every collective's timeout unless the strategy or MANUALPAR_TIMEOUT_S says otherwise.
DEFAULT_TIMEOUT = timedelta(minutes=5)
TIMEOUT_ENV_VAR = "MANUALPAR_TIMEOUT_S"


def resolve_timeout(timeout: float | timedelta | None) -> timedelta:
    """Argument, else $MANUALPAR_TIMEOUT_S, else 5 minutes; never torch's 30-minute default."""
    if timeout is None:
        raw = os.environ.get(TIMEOUT_ENV_VAR)
        if raw is None:
            return DEFAULT_TIMEOUT
        try:
            timeout = float(raw)
        except ValueError:
            raise ClusterEnvironmentError(
                f"{TIMEOUT_ENV_VAR}={raw!r} is not a number of seconds; set it to e.g. 120 or "
                "unset it for the 5-minute default"
            ) from None
    if not isinstance(timeout, timedelta):
        timeout = timedelta(seconds=float(timeout))
    if timeout.total_seconds() <= 0:
        raise ConfigError(
            f"collective timeout must be positive, got {timeout.total_seconds():g} s; "
            f"pass seconds > 0 (or set {TIMEOUT_ENV_VAR})"
        )
    return timeout
