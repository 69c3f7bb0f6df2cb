"""The continuous-batching decoder, in process on the tiny model: exact against HF, requests
joining and leaving between steps, slots freed at once, pause modes, stop rules."""

from __future__ import annotations

import copy
import time

import pytest
import torch

from rlkit.rollout.engines.builtin.batched_decoder import BatchedDecoder, DecodeParams, DecodeRequest
from tests.rollout.helpers import LOGPROB_TOLERANCE, teacher_forced_logprobs

PROMPTS = [[5, 9, 13], [7] * 11, [100, 200, 300, 400, 5, 6, 7, 8, 9], [42]]


@pytest.fixture
def decoder(tiny_model):
    d = BatchedDecoder(tiny_model, eos_token_ids={0}, max_running_requests=8)
    d.start()
    yield d
    d.stop()


def req(rid, prompt, **params) -> DecodeRequest:
    params.setdefault("max_new_tokens", 12)
    params.setdefault("ignore_eos", True)
    return DecodeRequest(rid=rid, input_ids=list(prompt), params=DecodeParams(**params))


def wait(requests, timeout=60.0):
    deadline = time.monotonic() + timeout
    while not all(r.finished for r in requests):
        assert time.monotonic() < deadline, "requests did not finish in time"
        time.sleep(0.002)


def run(decoder, requests):
    for r in requests:
        decoder.submit(r)
    wait(requests)
    return requests


def greedy_reference(model, prompt, n):
    out = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                         max_new_tokens=n, do_sample=False, pad_token_id=0, eos_token_id=None)
    return out[0, len(prompt):].tolist()


def test_concurrent_greedy_matches_hf_generate(decoder, tiny_model):
    rs = run(decoder, [req(f"g{i}", p, temperature=0.0) for i, p in enumerate(PROMPTS)])
    for p, r in zip(PROMPTS, rs):
        assert r.output_ids == greedy_reference(tiny_model, p, 12)
        assert r.finish_reason.type == "length" and r.finish_reason.length == 12


@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_sampled_logprobs_equal_teacher_forcing(decoder, tiny_model, temperature):
    rs = run(decoder, [req(f"s{i}", p, temperature=temperature, seed=i, max_new_tokens=20)
                       for i, p in enumerate(PROMPTS)])
    for p, r in zip(PROMPTS, rs):
        ref = teacher_forced_logprobs(tiny_model, p, r.output_ids, temperature)
        assert max(abs(a - b) for a, b in zip(ref, r.output_logprobs)) < LOGPROB_TOLERANCE


@pytest.mark.parametrize("temperature", [1.0, 0.6, 0.0])
def test_input_logprobs_from_logprob_start_len_equal_teacher_forcing(decoder, tiny_model,
                                                                      temperature):
    """SGLang's logprob_start_len k: the logprobs of input tokens k+1 .. n-1 (None first when
    k = 0), at the sampling temperature, for requests of several lengths and starts in one
    left-padded prefill beside a request that scores nothing."""
    starts = [0, 5, 4, -1]  # PROMPTS[3] is one token: it scores nothing
    rs = []
    for i, (p, k) in enumerate(zip(PROMPTS, starts)):
        r = req(f"in{i}", p, temperature=temperature, seed=i, max_new_tokens=3)
        r.logprob_start_len = k
        rs.append(r)
    run(decoder, rs)
    for p, k, r in zip(PROMPTS, starts, rs):
        if k < 0:
            assert r.input_logprobs is None
            continue
        ref = teacher_forced_logprobs(tiny_model, p[:k + 1], p[k + 1:], temperature)
        got = r.input_logprobs[1:] if k == 0 else r.input_logprobs
        assert (r.input_logprobs[0] is None) == (k == 0)
        assert len(got) == len(p) - k - 1
        assert max(abs(a - b) for a, b in zip(ref, got)) < LOGPROB_TOLERANCE
        # the sampled tokens are unchanged by the wider logits
        ref_out = teacher_forced_logprobs(tiny_model, p, r.output_ids, temperature)
        assert max(abs(a - b) for a, b in zip(ref_out, r.output_logprobs)) < LOGPROB_TOLERANCE


def test_a_request_joining_a_running_batch_gets_the_same_tokens(decoder):
    alone = run(decoder, [req("alone", PROMPTS[2], seed=11, max_new_tokens=30)])[0]
    # Now the same request joins while others are mid-generation, and others leave meanwhile.
    long_ones = [req(f"bg{i}", p, seed=i, max_new_tokens=60) for i, p in enumerate(PROMPTS)]
    short = [req("short", PROMPTS[0], seed=5, max_new_tokens=3)]
    for r in long_ones + short:
        decoder.submit(r)
    while len(long_ones[0].output_ids) < 10:
        time.sleep(0.001)
    joined = req("joined", PROMPTS[2], seed=11, max_new_tokens=30)
    decoder.submit(joined)
    wait(long_ones + short + [joined])
    assert joined.output_ids == alone.output_ids
    assert joined.first_token_at < long_ones[0].finished_at  # it really joined mid-run
    assert short[0].finished_at < joined.first_token_at  # and others had left before


def test_a_finished_request_frees_its_slot_at_once(tiny_model):
    d = BatchedDecoder(tiny_model, eos_token_ids={0}, max_running_requests=2)
    d.start()
    try:
        quick = req("quick", PROMPTS[0], max_new_tokens=2)
        slow = req("slow", PROMPTS[1], max_new_tokens=200)
        waiting = req("waiting", PROMPTS[3], max_new_tokens=2)
        for r in (quick, slow, waiting):
            d.submit(r)
        wait([quick, waiting])
        # `waiting` got quick's slot and finished while `slow` still runs
        assert not slow.finished
        assert d.loads()["num_running_reqs"] == 1
        d.abort("slow")
        wait([slow])
    finally:
        d.stop()


def test_abort_keeps_partial_tokens_and_empties_the_engine(decoder):
    running = req("r", PROMPTS[0], max_new_tokens=2000)
    decoder.submit(running)
    while len(running.output_ids) < 5:
        time.sleep(0.001)
    decoder.abort("r")
    wait([running])
    assert running.finish_reason.type == "abort"
    assert 5 <= len(running.output_ids) == len(running.output_logprobs) < 2000
    assert decoder.loads()["num_running_reqs"] == 0


def test_aborting_one_request_mid_batch_keeps_the_others_exact(decoder):
    """A cancelled request (tail batching cancels speculative responses one by one) leaves the
    batch from the middle: the last row moves into its hole, and the others go on unchanged."""
    alone = run(decoder, [req(f"a{i}", p, seed=i, max_new_tokens=40) for i, p in enumerate(PROMPTS)])
    batch = [req(f"b{i}", p, seed=i, max_new_tokens=40) for i, p in enumerate(PROMPTS)]
    victim = req("victim", PROMPTS[1], seed=99, max_new_tokens=4000)
    for r in batch[:2] + [victim] + batch[2:]:
        decoder.submit(r)
    while len(victim.output_ids) < 3:
        time.sleep(0.001)
    decoder.abort("victim")
    wait(batch + [victim])
    assert victim.finish_reason.type == "abort"
    assert [r.output_ids for r in batch] == [r.output_ids for r in alone]
    assert all(r.finish_reason.type == "length" for r in batch)


def test_abort_all_reaches_queued_requests(tiny_model):
    d = BatchedDecoder(tiny_model, eos_token_ids={0}, max_running_requests=1)
    d.start()
    try:
        first, queued = req("a", PROMPTS[0], max_new_tokens=2000), req("b", PROMPTS[1])
        d.submit(first)
        d.submit(queued)
        while not first.output_ids:
            time.sleep(0.001)
        d.abort(abort_all=True)
        wait([first, queued])
        assert queued.finish_reason.type == "abort" and queued.output_ids == []
        assert first.finish_reason.type == "abort" and first.output_ids
    finally:
        d.stop()


@pytest.mark.parametrize("mode", ["in_place", "retract"])
def test_pause_freezes_and_continue_resumes_identically(decoder, mode):
    reference = run(decoder, [req("ref", PROMPTS[2], seed=3, max_new_tokens=80)])[0]
    r = req("p", PROMPTS[2], seed=3, max_new_tokens=80)
    decoder.submit(r)
    while len(r.output_ids) < 10:
        time.sleep(0.001)
    decoder.pause(mode).result(10)
    frozen = len(r.output_ids)
    time.sleep(0.2)
    assert len(r.output_ids) == frozen and not r.finished
    loads = decoder.loads()
    if mode == "retract":  # KV dropped: the request waits in the queue with its tokens
        assert loads["num_running_reqs"] == 0 and loads["num_waiting_reqs"] == 1
        assert decoder.flush().result(10) is True
    else:  # KV kept: flush must refuse, as SGLang's does
        assert loads["num_running_reqs"] == 1
        assert decoder.flush().result(10) is False
    decoder.resume().result(10)
    wait([r])
    assert r.output_ids == reference.output_ids
    assert r.retractions == (1 if mode == "retract" else 0)


def test_pause_abort_aborts_and_holds_new_requests(decoder):
    r = req("x", PROMPTS[0], max_new_tokens=2000)
    decoder.submit(r)
    while not r.output_ids:
        time.sleep(0.001)
    assert decoder.pause("abort").result(10) == 1
    wait([r])
    assert r.finish_reason.type == "abort"
    held = req("held", PROMPTS[1], max_new_tokens=3)
    decoder.submit(held)
    time.sleep(0.2)
    assert held.output_ids == [] and decoder.loads()["num_waiting_reqs"] == 1
    decoder.resume().result(10)
    wait([held])
    assert len(held.output_ids) == 3


def test_stop_tokens_eos_ignore_eos_and_min_new_tokens(tiny_model):
    greedy = greedy_reference(tiny_model, PROMPTS[1], 20)
    stop_at = greedy[3]
    first_hit = greedy.index(stop_at)
    d = BatchedDecoder(tiny_model, eos_token_ids={stop_at}, max_running_requests=8)
    d.start()
    try:
        eos, ignored, held, stop_id = run(d, [
            req("eos", PROMPTS[1], temperature=0.0, max_new_tokens=20, ignore_eos=False),
            req("ign", PROMPTS[1], temperature=0.0, max_new_tokens=20, ignore_eos=True),
            req("min", PROMPTS[1], temperature=0.0, max_new_tokens=20, ignore_eos=False,
                min_new_tokens=first_hit + 3),
            DecodeRequest(rid="sid", input_ids=PROMPTS[1], params=DecodeParams(
                max_new_tokens=20, temperature=0.0, stop_token_ids=frozenset({greedy[5]}))),
        ])
    finally:
        d.stop()
    assert eos.output_ids == greedy[:first_hit + 1]
    assert eos.finish_reason.type == "stop" and eos.finish_reason.matched == stop_at
    assert ignored.output_ids == greedy and ignored.finish_reason.type == "length"
    # before min_new_tokens, EOS is masked out: it can't appear there
    assert stop_at not in held.output_ids[:first_hit + 3]
    assert len(held.output_ids) >= first_hit + 3
    # stop_token_ids stop at the first occurrence of that token
    assert stop_id.output_ids[-1] == greedy[5] and stop_id.finish_reason.type == "stop"


def test_trace_replay_lengths_are_exact(decoder):
    lengths = [1, 7, 33, 2, 64, 15]
    rs = run(decoder, [req(f"t{i}", PROMPTS[i % 4], max_new_tokens=n, seed=i) for i, n in enumerate(lengths)])
    assert [len(r.output_ids) for r in rs] == lengths


def test_stop_strings(tiny_model, tiny_tokenizer):
    greedy = greedy_reference(tiny_model, PROMPTS[0], 15)
    text = tiny_tokenizer.decode(greedy[:6], skip_special_tokens=False)
    stop = text[-2:] if len(text) >= 2 else text
    d = BatchedDecoder(tiny_model, eos_token_ids={0},
                       detokenize=lambda ids: tiny_tokenizer.decode(ids, skip_special_tokens=False))
    d.start()
    try:
        r = run(d, [req("ss", PROMPTS[0], temperature=0.0, max_new_tokens=15,
                        stop_strings=(stop,))])[0]
    finally:
        d.stop()
    assert r.finish_reason.type == "stop" and r.finish_reason.matched == stop
    assert stop in tiny_tokenizer.decode(r.output_ids, skip_special_tokens=False)
    assert len(r.output_ids) <= 6


def test_kv_capacity_admission_holds_requests_until_tokens_free(tiny_model):
    d = BatchedDecoder(tiny_model, eos_token_ids={0}, max_running_requests=8, max_total_tokens=40)
    d.start()
    try:
        a, b = req("a", PROMPTS[1], max_new_tokens=20), req("b", PROMPTS[1], max_new_tokens=20)
        d.submit(a)
        d.submit(b)
        while not a.output_ids:
            time.sleep(0.001)
        assert b.output_ids == [] and d.loads()["num_waiting_reqs"] == 1  # 31 + 31 > 40
        wait([a, b])
        assert b.first_token_at >= a.first_token_at
    finally:
        d.stop()


def test_context_length_ends_with_length(tiny_model):
    d = BatchedDecoder(tiny_model, eos_token_ids={0}, context_length=16)
    d.start()
    try:
        r = run(d, [req("c", PROMPTS[1], max_new_tokens=100)])[0]
    finally:
        d.stop()
    assert len(PROMPTS[1]) + len(r.output_ids) == 16 and r.finish_reason.type == "length"


def test_weights_loaded_between_steps_change_the_output(tiny_model):
    from rlkit.rollout.engines.builtin.weight_receiver import load_into_model

    model = copy.deepcopy(tiny_model)
    d = BatchedDecoder(model, eos_token_ids={0})
    d.start()
    try:
        before = run(d, [req("w0", PROMPTS[0], temperature=0.0)])[0].output_ids
        new = {n: t + 0.05 * torch.randn_like(t) for n, t in model.state_dict().items()
               if n.endswith("weight") and "norm" not in n}
        d.call(lambda: load_into_model(model, new)).result(10)
        d.set_weight_version("1").result(10)
        after = run(d, [req("w1", PROMPTS[0], temperature=0.0)])[0]
    finally:
        d.stop()
    assert after.output_ids != before and after.weight_version == "1"


def test_a_crash_fails_requests_instead_of_hanging(tiny_model):
    d = BatchedDecoder(tiny_model, eos_token_ids={0})
    d.start()
    try:
        bad = req("bad", [10_000], max_new_tokens=3)  # out of vocabulary: the forward raises
        d.submit(bad)
        wait([bad], timeout=20)
        assert bad.finish_reason.type == "abort" and bad.finish_reason.status_code == 500
        assert not d.alive and "IndexError" in (d.crashed or "")
    finally:
        d.stop()


def test_loads_timestamp_moves_with_each_layer_of_a_forward_and_not_while_stuck(tiny_model):
    """The progress the health monitor reads (`loads()["timestamp"]`, SGLang's LoadSnapshot
    field): it moves when a decoder layer of a forward is done, so one long CPU prefill shows
    progress before it ends, and stays while the decoder is stuck inside a layer."""
    import threading

    d = BatchedDecoder(tiny_model, eos_token_ids={0}, max_running_requests=8)
    layers = list(tiny_model.model.layers)
    assert len(layers) >= 2
    entered = [threading.Event() for _ in layers[:2]]
    release = [threading.Event() for _ in layers[:2]]
    armed = {"on": True}

    def gate(i):
        def hook(module, args, output):  # runs after the decoder's own hook on this layer
            if armed["on"] and args[0].shape[1] > 1:  # the prefill, not a decode step
                entered[i].set()
                assert release[i].wait(30)
        return hook

    gates = [layer.register_forward_hook(gate(i)) for i, layer in enumerate(layers[:2])]
    d.start()
    try:
        r = req("p", PROMPTS[1], max_new_tokens=4)
        d.submit(r)
        assert entered[0].wait(30)  # inside the prefill, layer 0 done
        stuck = d.loads()["timestamp"]
        time.sleep(0.05)
        assert d.loads()["timestamp"] == stuck  # stuck in the forward: no move
        assert d.stats.prefill_forwards == 0
        release[0].set()
        assert entered[1].wait(30)  # layer 1 done, the forward not yet
        moved = d.loads()["timestamp"]
        assert moved > stuck and d.stats.prefill_forwards == 0
        armed["on"] = False
        release[1].set()
        wait([r])
        assert d.loads()["total_prefill_uncached_tokens"] == len(PROMPTS[1])
        assert d.loads()["timestamp"] >= moved
    finally:
        for e in release:
            e.set()
        for g in gates:
            g.remove()
        d.stop()
    assert d._layer_hooks == []  # the shared model keeps no hook of this decoder


def test_an_idle_decoder_gives_its_kv_growth_back_and_generates_the_same_after(decoder, tiny_model):
    """Once nothing runs, the KV cache returns to its first size (sync mode trains now, on the
    same machine: rlkit/common/memory.py); the next requests grow it again and decode as
    before."""
    first = decoder.memory_state()["kv_cache_bytes"]
    prompts = [[3 + i] * 40 for i in range(8)]
    run(decoder, [req(f"long{i}", p, max_new_tokens=300, temperature=0.0) for i, p in enumerate(prompts)])
    deadline = time.monotonic() + 60
    while decoder.memory_state()["kv_cache_bytes"] != first:  # the decoder thread shrinks it
        assert time.monotonic() < deadline, "the idle decoder kept its grown KV cache"
        time.sleep(0.01)
    assert decoder.cache.slots == 4 and decoder.cache.capacity == 64
    again = run(decoder, [req(f"g{i}", p, temperature=0.0) for i, p in enumerate(PROMPTS)])
    for p, r in zip(PROMPTS, again):
        assert r.output_ids == greedy_reference(tiny_model, p, 12)
