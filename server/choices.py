"""`n` > 1: one engine request per choice, and their streams merged into one response.

Choice i of a seeded request runs with seed + i (so each choice is reproducible and the choices
differ); unseeded choices draw their own random seeds. The engine runs the n requests like any
others (today one after another); usage counts the prompt once and the completions summed.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator, Callable
from typing import TypeVar

from engine.types import SamplingParams
from server.generation import Generation
from server.protocol import SEED_MODULUS

T = TypeVar("T")


def choice_request_id(response_id: str, index: int) -> str:
    """Engine request id of choice `index`; choice 0 keeps the response id (n = 1 as before)."""
    return response_id if index == 0 else f"{response_id}-{index}"


def choice_params(params: SamplingParams, index: int) -> SamplingParams:
    if params.seed is None or index == 0:
        return params
    return dataclasses.replace(params, seed=(params.seed + index) % SEED_MODULUS)


def start_choices(num_choices: int, params: SamplingParams,
                  start: Callable[[int, SamplingParams], Generation]) -> list[Generation]:
    """Submit every choice (start(index, params) -> Generation); if one is refused (queue full,
    engine down), those already submitted are cancelled and the error goes to the client."""
    gens: list[Generation] = []
    try:
        for index in range(num_choices):
            gens.append(start(index, choice_params(params, index)))
    except BaseException:
        for gen in gens:
            gen.cancel()
        raise
    return gens


async def merge_streams(streams: list[AsyncIterator[T]]) -> AsyncIterator[T]:
    """The items of every stream in arrival order. A failing stream ends the merge with its error;
    leaving the merge early (or a failure) cancels the streams still running, which frees their
    engine requests."""
    if len(streams) == 1:
        async for item in streams[0]:
            yield item
        return
    queue: asyncio.Queue[tuple[bool, T | None, BaseException | None]] = asyncio.Queue()

    async def pump(stream: AsyncIterator[T]) -> None:
        try:
            async for item in stream:
                queue.put_nowait((False, item, None))
        except Exception as exc:
            queue.put_nowait((True, None, exc))
        else:
            queue.put_nowait((True, None, None))

    tasks = [asyncio.ensure_future(pump(stream)) for stream in streams]
    try:
        running = len(tasks)
        while running:
            ended, item, error = await queue.get()
            if error is not None:
                raise error
            if ended:
                running -= 1
            else:
                yield item  # type: ignore[misc]  # an item, not the end marker
    finally:
        for task in tasks:
            task.cancel()
