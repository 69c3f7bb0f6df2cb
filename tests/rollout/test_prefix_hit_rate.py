"""rollout/prefix_hit_rate: EngineClient adds up each ended request's prompt tokens and the
ones its engine served from its prefix cache (SGLang's meta_info cached_tokens), and hands the
share out once per read (issue 32 item 4)."""

from __future__ import annotations


from rlkit.buffers.sample import Sample
from rlkit.rollout.http.client import EngineClient
from rlkit.rollout.config import SamplingConfig
from tests.rollout.fake_worker import answer_json, answer_sse
from tests.rollout.helpers import fixture_json, fixture_text

SAMPLING = SamplingConfig(max_new_tokens=64)


async def test_cached_prompt_tokens_over_prompt_tokens_per_read(worker):
    # real SGLang answers: 158 of 184 prompt tokens cached (JSON), 0 of 12 (an SSE stream,
    # counted once, from its final chunk, though every chunk repeats the counts)
    worker.generate.append(answer_json(fixture_json("generate_logprobs.json")))
    worker.generate.append(answer_sse(fixture_text("generate_stream_cumulative.sse")))
    c = await EngineClient(None, worker_urls=[worker.url]).connect()
    try:
        assert c.prefix_cache_metrics() == {}  # nothing ended yet
        c.stream = False
        await c.generate(Sample(index=0, group_id=0, prompt_ids=[1, 2, 3]), SAMPLING,
                         max_new_tokens=1, version=0, worker=worker.url)
        c.stream = True
        await c.generate(Sample(index=1, group_id=0, prompt_ids=[1, 2, 3]), SAMPLING,
                         max_new_tokens=10, version=0, worker=worker.url)
        assert c.prefix_cache_metrics() == {"rollout/prefix_hit_rate": 158 / 196,
                                            "rollout/prefix_cached_tokens": 158.0,
                                            "rollout/prefix_prompt_tokens": 196.0}
        assert c.prefix_cache_metrics() == {}  # each read starts the next count
    finally:
        await c.close()


def test_answers_without_the_counts_leave_it_out():
    c = EngineClient("http://127.0.0.1:1")
    c._count_prefix({"prompt_tokens": 5})  # an engine that does not say what it cached
    c._count_prefix({"cached_tokens": 9, "prompt_tokens": 4})  # clipped to the prompt
    assert c.prefix_cache_metrics()["rollout/prefix_hit_rate"] == 1.0
