"""A generator: the built-in `multi_turn` loop (model turn, environment step, observation) with
a turn counter at the start of every observation, "[turn 3/8] now 24" (the total is the
environment's `max_turns`, when it has one), so the model knows how many moves it has left.

A tool call abandoned by a park is re-run on resume; `ctx.tool_step` first puts an environment
with snapshot/restore back as it was before the call, so the call takes effect once.

Everything the loop needs to resume is in `ctx.state` (plain data, saved with the buffer):
`phase` says where the episode stands, and each phase change is written in the same
synchronous block as the work it records (no `await` in between), so a park can never split
them. A parked episode re-enters this function and goes on from `phase`."""

from __future__ import annotations

from rlkit.rollout.episodes import EpisodeContext


async def hinted_turns(ctx: EpisodeContext) -> None:
    st, env = ctx.state, ctx.env
    while True:
        if st.get("phase", "model") == "model":
            turn = await ctx.model_turn()
            if turn.ended != "stop":
                return  # parked mid-turn (resumed from its tokens), or out of budget
            st.update(phase="tool", action=turn.text)  # st["turns"]: the runner counts turns
        obs = await ctx.tool_step(st["action"])
        if obs is None:
            return  # the step ended during the call: parked, re-run on resume
        if obs.done:
            st["phase"] = "done"
            ctx.finish(obs.reward)
            return
        st["phase"] = "model"
        total = getattr(env, "max_turns", None)
        ctx.append_observation(f"[turn {st['turns']}/{total}] {obs.text}" if total else
                               f"[turn {st['turns']}] {obs.text}")
        if ctx.sample.status.terminal:
            return  # the observation filled the token budget
