"""The endpoint's batcher (rollout/endpoint/engine.py) merges two cohorts of sessions into one batch: sessions whose
first calls arrived apart (a gap past the gathering window) go together from the next batch on, instead of
alternating batch after batch (which halves the batch a generator decodes).
The generator is a stand-in here (a coroutine that takes a fixed time per batch): what is tested is the gathering."""
from __future__ import annotations

import asyncio

from qgrpo.core.records import Completion


def test_two_cohorts_of_sessions_merge_into_one_batch_after_their_first_calls():
    from qgrpo.rollout.endpoint.engine import Batcher

    sizes: list[int] = []

    async def run(slot, sequences, sampling):
        sizes.append(len(sequences))
        await asyncio.sleep(2.0)  # one batch's decode (the gathering waits up to a tenth of it)
        return 0, [Completion(token_ids=[5], logprobs=[-0.1], finish_reason="length", text="x") for _ in sequences]

    async def main():
        batcher = Batcher(run, 1, stop_ids=[0])

        async def session(i: int, start: float):
            await asyncio.sleep(start)
            for _ in range(3):
                await batcher.sample(0, [1, 2], 1, 1.0, 1.0, 0, None)
                await asyncio.sleep(0.008 * (i % 10))  # answers handled one by one: 8 ms apart
        try:
            # cohort A at 0 s, cohort B 0.2 s later: B's calls wait through A's first batch
            await asyncio.gather(*(session(i, 0.0) for i in range(10)), *(session(i, 0.2) for i in range(10, 20)))
        finally:
            batcher.close()

    asyncio.run(main())
    # cohort A's first calls alone; then B's first calls (which waited) with A's second ones, and from there on every
    # session's call in one batch: 4 batches of the 60 calls (the two cohorts alternating made 6, none above 12)
    assert sizes == [10, 20, 20, 10], sizes


def test_calls_the_endpoint_is_still_rendering_are_waited_for():
    """Sessions' calls that reach the endpoint together are rendered one after another (10 ms apart here, more than
    the gathering window): the batcher waits for those the endpoint counts as coming, and decodes them as one
    batch."""
    from qgrpo.rollout.endpoint.engine import Batcher

    sizes: list[int] = []
    coming = [20]

    async def run(slot, sequences, sampling):
        sizes.append(len(sequences))
        await asyncio.sleep(0.2)
        return 0, [Completion(token_ids=[5], logprobs=[-0.1], finish_reason="length", text="x") for _ in sequences]

    async def main():
        batcher = Batcher(run, 1, stop_ids=[0], coming=lambda slot: coming[0])

        async def call(i: int):
            await asyncio.sleep(0.01 * i)  # its rendering done
            coming[0] -= 1
            await batcher.sample(0, [1, 2], 1, 1.0, 1.0, 0, None)
        try:
            await asyncio.gather(*(call(i) for i in range(20)))
        finally:
            batcher.close()

    asyncio.run(main())
    assert sizes == [20], sizes
