"""The driver modes, one short loop each, and their registry (recipe key `mode`).

Every mode trains each rollout batch the same way (train/stream.py) and ends each step the same
way (`Run.end_step`: train what is left, push weights, report); they differ only in where
they wait:

    sync    rollout step -> train on its batch -> push weights.
    stream  each group goes to the trainer as it completes: forward/backward overlaps
            generation; the optimizer steps when the batch is complete. Same updates as sync.
    async   generation of step k+1 runs (with the weights of step k-1) while step k trains;
            the weights reach the engines mid-generation and in-flight requests go on with
            them. The buffer bounds the lag (rollout.max_staleness); a bound of 0 admits no
            overlap, and the loop is then sync's, step for step.

Colocated (cluster.placement), engines and trainer take turns on the same GPUs: only sync
mode's loop has the turns, since stream and async need both sides at once (the recipe refuses
them). The engines sleep after the step's rollout (`Run.to_training`) and wake with the new
weights at the push; the trainer frees its GPU memory in between.

Held-out evaluation (recipe `eval`) runs on the same engines when due: between steps in sync
and stream (the loop waits for it), beside the next rollout in async (the next weight sync
waits for it, so every eval response comes from the version it began with).

The simulator (rlkit/sim/simulate.py) runs these same loops in virtual time.
"""

from __future__ import annotations

import asyncio
from typing import Awaitable, Callable

from rlkit.config.modes import MODE_NAMES
from rlkit.driver.loop import Handed, LoopState, Run


async def run_sync(run: Run) -> LoopState:
    s = run.state
    run.start()
    await run.evaluate()  # the initial policy, when eval.before_first_step
    while s.step < run.num_steps:
        result = await run.rollout.start_step(s.version, for_version=s.version,
                                              final=run.is_final(s.step + 1), take=run.batch_size)
        handed = result.handed  # the batch comes with the result: no round trip of its own
        await run.to_training()  # colocated: the engines sleep, the trainer wakes on their GPUs
        run.trainer.begin(s.version)
        run.trainer.add(handed)
        await run.end_step(result, handed)  # train, push weights (colocated: engines wake), report
        await run.evaluate()  # held-out sets on the new weights, when due
    return s


async def run_stream(run: Run) -> LoopState:
    s = run.state
    run.start()
    await run.evaluate()
    while s.step < run.num_steps:
        handle = run.rollout.start_step(s.version, for_version=s.version,
                                        final=run.is_final(s.step + 1))
        run.trainer.begin(s.version)
        handed = await _stream_into(run, handle)  # each group to the trainer as it completes
        await run.end_step(await handle, handed)  # only what streaming could not hide is left
        await run.evaluate()
    return s


async def run_async(run: Run) -> LoopState:
    s = run.state
    run.start()
    run.start_eval()  # beside the first rollout
    pending = None
    while s.step < run.num_steps:
        if pending is None:  # the first step, or a bound that admitted no overlap
            pending = run.rollout.start_step(s.version, for_version=s.version,
                                             final=run.is_final(s.step + 1))
        result = await pending
        # Taken now, not at the step's end: a step that overlapped the last sync may end
        # before it, and its groups are trained (and their lag counted) at the version after.
        handed = await run.rollout.take(run.batch_size)
        pending = None
        # Step k+1 generates with the current weights while step k trains, if its groups,
        # trained one version later, stay within the staleness bound.
        if s.step + 1 < run.num_steps and await run.rollout.admits(s.version + 1):
            pending = run.rollout.start_step(s.version, for_version=s.version + 1,
                                             final=run.is_final(s.step + 2))
        run.trainer.begin(s.version)
        run.trainer.add(handed)
        # the weight sync lands mid-generation: in-flight requests go on with the new weights
        await run.end_step(result, handed, **{"async/overlapped": float(pending is not None)})
        run.start_eval()  # beside the next rollout; the next weight sync waits for it
    await run.eval_done()
    return s


# The loop of each mode rlkit.config.modes names (the names are data there, for the schema).
MODES: dict[str, Callable[[Run], Awaitable[LoopState]]] = {
    "sync": run_sync,
    "stream": run_stream,
    "async": run_async,
}
assert tuple(MODES) == MODE_NAMES, "rlkit.config.modes and the loops disagree"


async def _stream_into(run: Run, handle: asyncio.Future) -> Handed:
    """Hand the step's groups to the trainer one by one as they become ready; a step that
    fails stops the stream with its error instead of leaving it waiting."""
    handed = Handed()
    for _ in range(run.batch_size):
        nxt = asyncio.ensure_future(run.rollout.next_ready())
        await asyncio.wait({nxt, handle}, return_when=asyncio.FIRST_COMPLETED)
        if not nxt.done() and handle.exception() is not None:
            nxt.cancel()
            await asyncio.gather(nxt, return_exceptions=True)
            raise handle.exception()  # type: ignore[misc]
        one = await nxt
        run.trainer.add(one)
        handed.extend(one)
    return handed
