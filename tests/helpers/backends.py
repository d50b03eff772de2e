"""Checks that every backend plugin's tests make alike."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from poot_core import Reason, Unsupported, open_executor


def assert_absent_device_is_refused(backend: str, names: tuple[str, ...], executor: Callable[[], object]) -> None:
    """On a machine without the backend's device: opening it by each of `names` (its name and aliases) is a
    BACKEND refusal naming `backend`, and so is building its executor class directly."""
    for name in names:
        with pytest.raises(Unsupported) as err:
            open_executor(name)
        assert err.value.reason is Reason.BACKEND and err.value.name == backend
    with pytest.raises(Unsupported) as err:
        executor()
    assert err.value.reason is Reason.BACKEND
