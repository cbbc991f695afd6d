"""The check that a Python call refuses bad input with one line naming what was wrong."""

from __future__ import annotations

import pytest


def refused(call, error=ValueError, *words: str, absent: tuple[str, ...] = ()) -> str:
    """`call()` raises `error` with one line holding every one of `words` and none of `absent`."""
    with pytest.raises(error) as info:
        call()
    message = str(info.value)
    assert "\n" not in message, message
    for word in words:
        assert word in message, message
    for word in absent:
        assert word not in message, message
    return message
