"""Waiting in tests for a state, not for a time: poll a condition until it holds, failing only after a
generous overall timeout. A fixed sleep followed by an assert, or a wall-clock budget, fails on a busy
2-core machine where the state arrives late but does arrive."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

WAIT_SECONDS = 60.0  # far beyond any state these tests wait for (they reach it in well under a second)
POLL_SECONDS = 0.02


def wait_until(condition: Callable[[], bool], what: str = "the condition", timeout: float = WAIT_SECONDS) -> None:
    """Return once condition() is true; AssertionError naming `what` after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not reached in {timeout:g} s")
        time.sleep(POLL_SECONDS)


async def async_wait_until(condition: Callable[[], bool], what: str = "the condition",
                           timeout: float = WAIT_SECONDS) -> None:
    """wait_until inside an event loop: sleeps without blocking the loop."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not reached in {timeout:g} s")
        await asyncio.sleep(POLL_SECONDS)
