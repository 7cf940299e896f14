"""serve's admission (``Turns``) on its own: the order in which requests reach models.

Pure asyncio, no processes: each request enters, records its model, holds its turn for
a while, and leaves, as the router does around a request.
"""

from __future__ import annotations

import asyncio

import pytest

pytest.importorskip("aiohttp")

from vramlock.serve import turns
from vramlock.serve.turns import Turns

pytestmark = pytest.mark.timeout(30)


async def request(turns: Turns, model: str, order: list[str], hold: float = 0.01) -> None:
    await turns.enter(model)
    try:
        order.append(model)
        await asyncio.sleep(hold)
    finally:
        turns.leave()


def test_interleaved_requests_are_served_grouped() -> None:
    async def main() -> list[str]:
        turns, order = Turns(), list[str]()
        await asyncio.gather(*(request(turns, m, order) for m in "ABABAB"))
        return order

    assert asyncio.run(main()) == list("AAABBB")


def test_a_client_s_next_request_keeps_its_model_s_turn_over_a_waiting_one() -> None:
    # A client of A sends its next request right after its last one's answer, while a
    # request for B waits: within LINGER, A's turn goes on (no swap to B and back).
    async def main() -> list[str]:
        turns, order = Turns(), list[str]()
        first = asyncio.ensure_future(request(turns, "A", order, hold=0.05))
        await asyncio.sleep(0.01)
        other = asyncio.ensure_future(request(turns, "B", order))
        await first
        await request(turns, "A", order)  # at once: within LINGER
        await other
        return order

    assert asyncio.run(main()) == list("AAB")


def test_clients_that_never_pause_take_bounded_turns(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(turns, "GROUP_WAIT", 0.2)

    async def main() -> list[str]:
        turns, order = Turns(), list[str]()
        loop = asyncio.get_running_loop()
        end = loop.time() + 1.5

        async def client(model: str) -> None:
            while loop.time() < end:
                await request(turns, model, order, hold=0.005)

        await asyncio.gather(client("A"), client("B"))
        return order

    order = asyncio.run(main())
    runs = [m for i, m in enumerate(order) if i == 0 or order[i - 1] != m]
    # both served, in turns of about GROUP_WAIT (not one request each, not one forever)
    assert set(runs) == {"A", "B"}
    assert 3 <= len(runs) <= 1.5 / 0.2 + 2, runs


def test_a_cancelled_waiter_gives_its_place_back() -> None:
    async def main() -> list[str]:
        turns, order = Turns(), list[str]()
        holder = asyncio.ensure_future(request(turns, "A", order, hold=0.1))
        await asyncio.sleep(0.01)
        gone = asyncio.ensure_future(request(turns, "B", order))
        await asyncio.sleep(0.01)
        gone.cancel()  # its client went away while it waited
        await holder
        await request(turns, "C", order)  # not stuck behind the cancelled one
        return order

    assert asyncio.run(main()) == ["A", "C"]


def test_queued_requests_of_higher_priority_go_first() -> None:
    async def main() -> list[str]:
        turns, order = Turns({"C": 10, "B": 5}), list[str]()
        holder = asyncio.ensure_future(request(turns, "A", order, hold=0.1))
        await asyncio.sleep(0.01)
        queued = []
        for model in "DBC":  # queued in this order while A is served
            queued.append(asyncio.ensure_future(request(turns, model, order)))
            await asyncio.sleep(0.01)
        await asyncio.gather(holder, *queued)
        return order

    assert asyncio.run(main()) == list("ACBD")


def test_a_client_that_alternates_models_waits_for_nothing() -> None:
    # One client, one request at a time, model A, B, A...: nobody else waits, so each
    # goes at once (each once waited a tenth of a second, for the last model's client:
    # 77 % more than a switch through run's proxy, two llama-servers on an H100).
    async def main() -> float:
        turns = Turns()
        loop = asyncio.get_running_loop()
        worst = 0.0
        for model in "ABABAB":
            started = loop.time()
            await turns.enter(model)
            worst = max(worst, loop.time() - started)
            turns.leave()
        return worst

    assert asyncio.run(main()) < 0.02
