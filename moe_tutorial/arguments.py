"""The checks of a caller's numbers that the API and the command line share: a count and a
positive number, each refused in one line naming the argument (the command line passes its flag's
name) before any work starts. Below every concern: the data, the training loop, the benchmarks
and the command line check with these.
"""

from __future__ import annotations

import math
import numbers


def check_count(name: str, value, *, least: int = 1) -> None:
    """Refuse a count that is not an integer >= `least` (bool, float and str included: a
    float seq_len or a negative slice bound would fail deep inside torch or drop data silently)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < least:
        raise ValueError(f"{name}={value!r} must be an integer >= {least}")


def check_positive_number(name: str, value) -> None:
    """Refuse a value that is not a finite number > 0 (bool and str included)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real) \
            or not (math.isfinite(value) and value > 0):
        raise ValueError(f"{name}={value!r} must be a finite number > 0")
