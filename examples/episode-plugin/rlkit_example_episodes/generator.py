"""A generator: the built-in `multi_turn` loop (model turn, environment step, observation) with
a turn counter at the start of every observation, "[turn 3/8] now 24" (the total is the
environment's `max_turns`, when it has one), so the model knows how many moves it has left.

A plain loop: a parked episode re-enters this function and rlkit replays it against the record
of its calls (model turns and tool results come back as they were, no engine or tool call) up
to where it was parked, then it goes on live (docs/episodes.md, "Resuming replays the
generator"). A tool call abandoned by the park runs on resume, once.
"""

from __future__ import annotations

from rlkit.rollout.episodes import EpisodeContext


async def hinted_turns(ctx: EpisodeContext) -> None:
    total = getattr(ctx.env, "max_turns", None)
    turns = 0
    while True:
        turn = await ctx.model_turn()
        if turn.ended != "stop":
            return  # parked mid-turn (resumed from its tokens), or out of budget
        turns += 1
        obs = await ctx.tool_step(turn.text)
        if obs is None:
            return  # the step ended during the call: parked, re-run on resume
        if obs.done:
            ctx.finish(obs.reward)
            return
        ctx.append_observation(f"[turn {turns}/{total}] {obs.text}" if total else
                               f"[turn {turns}] {obs.text}")
        if ctx.sample.status.terminal:
            return  # the observation filled the token budget
