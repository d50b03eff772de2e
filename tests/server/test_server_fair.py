"""Tenants reach the scheduler: tickets of two tenants of one priority, queued on the engine bridge before its
thread starts (so the engine holds all of them before its first step), finish in turn, one running slot at a
time, although one tenant submitted first and six times as many; a tenant of higher priority goes first."""

from __future__ import annotations

import asyncio

from helpers import smollm
from poot_core import Driver, DriverOptions, GenerateRequest, Layout, ModelHandle, open_executor
from poot_core.server.bridge import Done, EngineBridge, Ticket


def test_bridge_finishes_tenants_in_turn():
    handle = ModelHandle.load(smollm.gguf_path())
    options = DriverOptions(capacity=64, prefill_chunk=32, block_size=16, step_tokens=64, max_running=1)
    bridge = EngineBridge(Driver(handle, open_executor("cpu"), options).serve(Layout.PAGED))

    async def run() -> list[str]:
        loop = asyncio.get_running_loop()
        names = [f"a{i}" for i in range(6)] + ["b0", "b1", "vip"]
        tickets = [Ticket(loop, GenerateRequest([1, 100 + i, 200], max_new=1, ignore_eos=True),
                          priority=1 if name == "vip" else 0, tenant=name[:1] if name != "vip" else "b")
                   for i, name in enumerate(names)]
        for t in tickets:
            bridge.submit(t)
        bridge.start()
        done: list[str] = []

        async def wait(name: str, ticket: Ticket) -> None:
            while not isinstance(item := await ticket.items.get(), Done):
                pass
            assert item.event.reason == "length"
            done.append(name)

        await asyncio.wait_for(asyncio.gather(*(wait(n, t) for n, t in zip(names, tickets, strict=True))), 120)
        return done

    try:
        order = asyncio.run(run())
    finally:
        bridge.stop()
    assert order == ["vip", "a0", "b0", "a1", "b1", "a2", "a3", "a4", "a5"]


def test_a_request_whose_images_fail_gets_an_error_not_silence():
    """A bug inside a request's vision tower run (before the engine has it) stops the engine thread; that request
    and the one queued behind it get an error instead of waiting for ever."""
    from poot_core.server.bridge import Rejected

    class BrokenTower:
        def embeddings(self, prompt, images):
            raise KeyError("vision.patch_embedding.weight")

    handle = ModelHandle.load(smollm.gguf_path())
    options = DriverOptions(capacity=64, prefill_chunk=32, block_size=16, step_tokens=64, max_running=1)
    bridge = EngineBridge(Driver(handle, open_executor("cpu"), options).serve(Layout.PAGED), images=BrokenTower())

    async def run() -> list:
        loop = asyncio.get_running_loop()
        tickets = [Ticket(loop, GenerateRequest([1, 100, 200], max_new=1, ignore_eos=True)) for _ in range(2)]
        tickets[0].images = ["an image"]
        for t in tickets:
            bridge.submit(t)
        bridge.start()
        return [await asyncio.wait_for(t.items.get(), 60) for t in tickets]

    try:
        items = asyncio.run(run())
    finally:
        bridge.stop()
    assert all(isinstance(item, Rejected) for item in items), items
    assert "vision.patch_embedding.weight" in str(items[0].error) and "engine failure" in str(items[1].error)
