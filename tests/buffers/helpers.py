from rlkit.buffers import ListPromptSource, RolloutBuffer
from rlkit.buffers.source import records_from_token_lists


def make_source(rows: int = 7, seed: int = 0) -> ListPromptSource:
    prompts = [[100 + i, 200 + i] for i in range(rows)]
    return ListPromptSource(records_from_token_lists(prompts, label=lambda i: str(i)), seed=seed)


def make_buffer(n: int = 2, rows: int = 7, **kw) -> RolloutBuffer:
    return RolloutBuffer(make_source(rows), n_samples_per_prompt=n, **kw)


def buffer_with_a_partial(n: int = 2) -> RolloutBuffer:
    """A buffer holding one parked group whose first sample has 3 tokens (what a checkpoint
    must carry across)."""
    buf = make_buffer(n=n)
    (g,) = buf.acquire(1)
    g.samples[0].start_request()
    g.samples[0].append([1, 2, 3], [-0.1] * 3, 0)
    buf.requeue(g)
    return buf


def finish(group, version: int, tokens: int = 2, reward: float = 1.0) -> None:
    """Generate every unfinished sample of the group to a stop, then reward it."""
    for s in group.to_generate():
        s.start_request()
        s.append([5] * tokens, [-0.5] * tokens, version, finish_reason="stop")
    for s in group.samples:
        if s.reward is None and not s.error:
            s.set_reward(reward)
