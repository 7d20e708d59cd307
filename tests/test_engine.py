"""The engine's interface without Ray: a failed step ends the requests it must and nothing else, the engine
recovers and serves on (sync `step`, and the `AsyncEngine` loop on `advance_async`), and chat prompts are
built and checked in one place."""

from __future__ import annotations

import asyncio
import threading
import time
from types import SimpleNamespace

import pytest

from pagedserve import LLM, LLMEngine, SamplingParams
from pagedserve.config import EngineConfig
from pagedserve.engine.async_engine import AsyncEngine, RequestFailed, _Stream
from pagedserve.executors import WorkerFailure
from pagedserve.outputs import CompletionOutput, RequestOutput


def greedy(max_tokens=8):
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)


@pytest.fixture(scope="module")
def reference(tiny_random):
    with LLM(tiny_random, max_model_len=256) as llm:
        yield {tuple(p): llm.generate([p], greedy(12))[0].outputs[0].token_ids for p in ([9, 8, 7], [5, 6, 7, 8])}


def fail_next_step(engine: LLMEngine, error: Exception, times: int = 1) -> None:
    """The next `times` steps launched on the worker raise `error` (as a dying worker or a bug would), later ones
    run."""
    worker = engine.executor.worker
    launch = worker.launch
    left = [times]

    def failing(batch, *late_masks):
        left[0] -= 1
        if not left[0]:
            worker.launch = launch
        raise error

    worker.launch = failing


def step_until_failed(engine: LLMEngine) -> list:
    """Step until a step reports the failure: the step after it, when one was launched ahead of the
    failing one, first reports as usual."""
    for _ in range(2):
        outputs = engine.step()
        if any(o.error for o in outputs):
            return outputs
        assert outputs and engine.schedules_ahead, "only a step launched ahead of the failing one reports"
    raise AssertionError("no step failed")


def drain(engine: LLMEngine) -> dict[str, object]:
    finished = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out
    return finished


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_worker_failure_fails_running_requests_keeps_queued_ones_and_recovers(tiny_random, reference,
                                                                              async_scheduling):
    engine = LLMEngine(EngineConfig(model=tiny_random, max_model_len=256, max_num_seqs=1,
                                    async_scheduling=async_scheduling))
    try:
        running = engine.add_request([9, 8, 7], greedy(12))
        engine.step()  # prefill: `running` holds blocks; with max_num_seqs=1 the next one waits
        queued = engine.add_request([5, 6, 7, 8], greedy(12))
        fail_next_step(engine, WorkerFailure("worker 0 died"))
        failed = step_until_failed(engine)
        assert [(o.request_id, o.finished, o.error) for o in failed] == [(running, True, "worker 0 died")]
        assert failed[0].outputs[0].finish_reason == "error"
        stats = engine.stats()
        assert stats["num_worker_failures"] == 1
        assert stats["num_free_blocks"] == stats["num_total_blocks"] and stats["num_cached_blocks"] == 0
        assert stats["num_waiting"] == 1
        done = drain(engine)
        assert list(done) == [queued] and done[queued].outputs[0].token_ids == reference[(5, 6, 7, 8)]
        again = engine.add_request([9, 8, 7], greedy(12))
        assert drain(engine)[again].outputs[0].token_ids == reference[(9, 8, 7)]
    finally:
        engine.shutdown()


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_a_worker_failure_during_a_prefill_runs_the_request_again_once(tiny_random, async_scheduling):
    """Nothing of a request in its (chunked) prefill has reached its caller: a worker failure sends it back to the
    queue, and it runs whole on the new workers, with the tokens it would have had; a second failure before it
    produced anything ends it (a request whose steps kill the workers does not run on and on)."""
    prompt = list(range(100, 140))  # three chunks of 16
    with LLM(tiny_random, max_model_len=256) as llm:
        expected = llm.generate([prompt], greedy(12))[0].outputs[0].token_ids
    engine = LLMEngine(EngineConfig(model=tiny_random, max_model_len=256, max_num_batched_tokens=16,
                                    async_scheduling=async_scheduling))
    try:
        first = engine.add_request(prompt, greedy(12))
        assert engine.step() == []  # its first chunk
        fail_next_step(engine, WorkerFailure("worker 0 died"))
        assert [o for o in engine.step() + engine.step() if o.error] == []
        assert drain(engine)[first].outputs[0].token_ids == expected
        assert engine.stats()["num_worker_failures"] == 1

        second = engine.add_request([t + 100 for t in prompt], greedy(12))  # no prefix of it cached
        engine.step()
        fail_next_step(engine, WorkerFailure("worker 0 died"))
        while engine.stats()["num_worker_failures"] < 2:
            assert [o for o in engine.step() if o.error] == []
        engine.step()  # its first chunk again
        fail_next_step(engine, WorkerFailure("worker 0 died"))
        failed = step_until_failed(engine)
        assert [(o.request_id, o.error) for o in failed] == [(second, "worker 0 died")]
        stats = engine.stats()
        assert stats["num_worker_failures"] == 3 and stats["num_free_blocks"] == stats["num_total_blocks"]
    finally:
        engine.shutdown()


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_an_engine_bug_fails_every_request_and_the_engine_serves_on(tiny_random, reference, async_scheduling):
    engine = LLMEngine(EngineConfig(model=tiny_random, max_model_len=256, max_num_seqs=1,
                                    async_scheduling=async_scheduling))
    try:
        first = engine.add_request([9, 8, 7], greedy(12))
        engine.step()
        second = engine.add_request([5, 6, 7, 8], greedy(12))
        fail_next_step(engine, IndexError("list index out of range"))
        failed = step_until_failed(engine)
        assert sorted(o.request_id for o in failed) == sorted([first, second])
        assert all(o.finished and o.error == "internal engine error: IndexError: list index out of range"
                   for o in failed)
        assert not engine.has_unfinished_requests()
        assert engine.stats()["num_worker_failures"] == 0
        # nothing says which K/V the failed step wrote: no cached block or tail survives it
        assert engine.block_manager.pool.num_cached_blocks == 0 and not engine.block_manager.pool._tails
        again = engine.add_request([5, 6, 7, 8], greedy(12))
        assert drain(engine)[again].outputs[0].token_ids == reference[(5, 6, 7, 8)]
    finally:
        engine.shutdown()


def test_offline_generate_raises_request_failed(tiny_random):
    with LLM(tiny_random, max_model_len=256) as llm:
        # the first failure sends it back to the queue (it had produced nothing), the second ends it
        fail_next_step(llm.llm_engine, WorkerFailure("worker 0 died"), times=2)
        with pytest.raises(RequestFailed, match="1 of 1 requests failed: worker 0 died"):
            llm.generate([[1, 2, 3]], greedy())
        assert llm.generate([[1, 2, 3]], greedy())[0].outputs[0].finish_reason == "length"


def test_async_engine_streams_fails_and_recovers(tiny_random, reference):
    async def collect(core, prompt):
        last = None
        async for out in core.generate(prompt, greedy(12)):
            last = out
        return last

    async def main():
        core = AsyncEngine(EngineConfig(model=tiny_random, max_model_len=256))
        try:
            ok = await asyncio.gather(*[collect(core, [9, 8, 7]) for _ in range(3)])
            fail_next_step(core.llm_engine, WorkerFailure("worker 0 died"), times=2)  # the second ends it
            with pytest.raises(RequestFailed, match="worker 0 died"):
                await collect(core, [5, 6, 7, 8])
            after = await collect(core, [5, 6, 7, 8])
            return ok, after, core.stats()
        finally:
            core.shutdown()

    ok, after, stats = asyncio.run(main())
    assert all(o.finished and o.outputs[0].token_ids == reference[(9, 8, 7)] for o in ok)
    assert after.outputs[0].token_ids == reference[(5, 6, 7, 8)]
    assert stats["num_worker_failures"] == 2 and stats["num_streams"] == 0
    assert stats["num_free_blocks"] == stats["num_total_blocks"]


def test_a_failed_step_reaches_its_callers_before_the_workers_are_replaced(tiny_random, reference):
    """Replacing workers loads the model again (seconds; minutes for a large one): the requests the failed step
    ended hear of it at once, not after, or a short deadline would end them first with nothing said. The health
    check passes meanwhile (a replica replaced mid-recovery would lose every request on it)."""
    async def main():
        core = AsyncEngine(EngineConfig(model=tiny_random, max_model_len=256))
        executor = core.llm_engine.executor
        replace, replacing, replaced = executor.restart, threading.Event(), threading.Event()

        def slow_restart():
            replacing.set()
            assert replaced.wait(timeout=120), "the test never let the replacement end"
            replace()

        executor.restart = slow_restart
        try:
            outputs = core.generate([9, 8, 7], greedy(12))
            first = await anext(outputs)
            assert first.outputs[0].token_ids and not first.finished
            fail_next_step(core.llm_engine, WorkerFailure("worker 0 died"))

            async def rest() -> None:
                async for _ in outputs:
                    pass

            with pytest.raises(RequestFailed, match="worker 0 died"):  # not a TimeoutError
                await asyncio.wait_for(rest(), 30)
            await asyncio.to_thread(replacing.wait, 30)
            await asyncio.wait_for(core.check_health(), 5)  # not the workers being replaced: still healthy
            assert core.llm_engine.restarting_since is not None
            replaced.set()
            after = core.generate([5, 6, 7, 8], greedy(12))
            return [out async for out in after][-1], core.stats()
        finally:
            replaced.set()
            core.shutdown()

    last, stats = asyncio.run(main())
    assert last.outputs[0].token_ids == reference[(5, 6, 7, 8)]
    assert stats["num_worker_failures"] == 1 and stats["num_free_blocks"] == stats["num_total_blocks"]


class TokenCounts:
    """A StepMetrics that keeps what the step loop reports of tokens."""

    def __init__(self) -> None:
        self.counts: list[tuple[int, int, int]] = []  # per step: tokens, first tokens, later tokens
        self.finished: list[list[str]] = []
        self.times: list[tuple[float, float | None]] = []  # per finished request: since arrival, of it queued

    def on_tokens(self, count: int, first_token_latencies: list[float], inter_token_latencies: list[float]) -> None:
        self.counts.append((count, len(first_token_latencies), len(inter_token_latencies)))

    def on_finish(self, reasons: list[str], prompt_tokens: int, seconds: float, queued_seconds: float | None) -> None:
        self.finished.append(reasons)
        self.times.append((seconds, queued_seconds))

    def on_step(self, seconds: float, stats: dict) -> None:
        pass

    def on_state(self, stats: dict) -> None:
        pass


@pytest.mark.parametrize("interval_ms", [0, 10_000])
def test_a_stream_interval_merges_outputs_and_loses_nothing(tiny_random, reference, interval_ms):
    """With an interval longer than the request, a stream yields its first output at once, then only the
    finished one, which holds every token; without one, each step's output. The metrics see every step
    either way: they count tokens where the engine makes them, not where a reader takes them."""
    async def main():
        metrics = TokenCounts()
        core = AsyncEngine(EngineConfig(model=tiny_random, max_model_len=256), metrics=metrics,
                           stream_interval_ms=interval_ms)
        try:
            outs = [[len(o.outputs[0].token_ids) for o in await collect_all(core, p)] for p in ([9, 8, 7],) * 2]
            last = (await collect_all(core, [5, 6, 7, 8]))[-1]
            stream = core.generate([1, 2, 3], greedy(100))
            await anext(stream)
            await stream.aclose()  # a caller gone after its first output
            return outs, last, metrics, core.stats(), dict(core.llm_engine.outputs.detokenizer._states)
        finally:
            core.shutdown()

    async def collect_all(core, prompt):
        return [out async for out in core.generate(prompt, greedy(12))]

    outs, last, metrics, stats, detokenizing = asyncio.run(main())
    for lengths in outs:
        assert lengths[-1] == 12 and lengths == sorted(set(lengths))
        if interval_ms:
            assert lengths == [1, 12]
        else:
            assert len(lengths) > 2  # a reader that keeps up sees the steps (12 here, unless it lags)
    assert last.finished and last.outputs[0].token_ids == reference[(5, 6, 7, 8)]
    assert metrics.counts[:36] == ([(1, 1, 0)] + [(1, 0, 1)] * 11) * 3 and metrics.counts[36] == (1, 1, 0)
    assert metrics.finished == [["length"]] * 3 + [["abort"]]
    assert all(0 <= queued < seconds for seconds, queued in metrics.times)  # every one was scheduled, then ran
    assert stats["num_streams"] == 0 and stats["num_free_blocks"] == stats["num_total_blocks"]
    assert detokenizing == {}  # every request's state freed: finished, and aborted with its output held


class OutputCounter:
    """Builds a request's output as `LLMEngine.output` does (its tokens so far), counting the builds."""

    def __init__(self) -> None:
        self.tokens = 0
        self.built = 0

    def output(self, request) -> RequestOutput:
        self.built += 1
        reason = "length" if request.finished else None
        return RequestOutput("r", None, [1], [CompletionOutput(0, "", list(range(self.tokens)), reason)],
                             request.finished)


def test_a_held_output_is_built_and_sent_when_the_interval_ends():
    """A request that gets tokens within the interval waits; when the interval ends a timer builds and sends
    its output, holding every token since, even if no newer ones come. Nothing is built that is not sent,
    and the last output is never held."""
    async def main():
        engine, request = OutputCounter(), SimpleNamespace(finished=False)
        stream = _Stream(request, arrival=0.0)
        got = []

        def step(tokens: int, finished: bool = False) -> None:
            engine.tokens, request.finished = tokens, finished
            stream.changed(engine, 0.05, time.monotonic(), finished)

        def sent() -> list[int]:
            return [len(stream.queue.get_nowait().outputs[0].token_ids) for _ in range(stream.queue.qsize())]

        step(1)  # the first: at once
        step(2)
        step(3)  # held, as the step before: neither is built
        got.append((sent(), engine.built))
        await asyncio.sleep(0.3)
        got.append((sent(), engine.built))
        step(4)  # the interval since the timer's send has passed: at once
        step(5)  # held
        step(6, finished=True)  # the last: at once, and the timer is cancelled
        got.append((sent(), engine.built, stream.timer))
        return got

    assert asyncio.run(main()) == [([1], 1), ([3], 2), ([4, 6], 4, None)]


def test_an_abort_while_an_output_is_held_ends_the_stream_at_once(tiny_random):
    """With a request's output held for a 10 s interval, `abort` sends its last output at once (every
    sample aborted, the tokens so far), the held one never follows, and nothing stays behind."""
    async def main():
        core = AsyncEngine(EngineConfig(model=tiny_random, max_model_len=256), stream_interval_ms=10_000)
        try:
            params = SamplingParams(temperature=0.8, seed=1, n=2, max_tokens=200, ignore_eos=True)
            stream = core.generate([9, 8, 7], params, request_id="held")
            first = await anext(stream)
            while core.llm_engine.scheduler.requests["held"].sequences[0].num_output_tokens < 5:
                await asyncio.sleep(0.01)  # tokens come, their output is held
            assert core.abort("held")
            rest = [out async for out in stream]
            return first, rest, core.stats(), dict(core.llm_engine.outputs.detokenizer._states)
        finally:
            core.shutdown()

    first, rest, stats, detokenizing = asyncio.run(main())
    assert not first.finished and len(rest) == 1 and rest[0].finished
    assert [c.finish_reason for c in rest[0].outputs] == ["abort", "abort"]
    assert all(len(c.token_ids) >= 5 for c in rest[0].outputs)
    assert stats["num_streams"] == 0 and stats["num_free_blocks"] == stats["num_total_blocks"]
    assert detokenizing == {}


@pytest.mark.parametrize("bad", [-1, "50", True, 10_001, float("nan")])
def test_a_bad_stream_interval_is_named(tiny_random, bad):
    with pytest.raises(ValueError, match="stream_interval_ms=.* must be a number of milliseconds"):
        AsyncEngine(EngineConfig(model=tiny_random, max_model_len=256), stream_interval_ms=bad)


def test_a_final_only_request_gets_one_output_equal_to_a_streamed_ones_last(tiny_random):
    """The offline LLM's requests build no output before they finish (`final_output_only`); the one they
    get holds what a request given an output every step ends with: text, tokens, named logprobs."""
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=2, prompt_logprobs=1)
    engine = LLMEngine(EngineConfig(model=tiny_random, max_model_len=256))
    try:
        streamed, final = (engine.inputs.make_request([9, 8, 7, 6], params) for _ in range(2))
        final.final_output_only = True
        engine.enqueue(streamed)
        engine.enqueue(final)
        seen: dict[str, list] = {streamed.request_id: [], final.request_id: []}
        while engine.has_unfinished_requests():
            for out in engine.step():
                seen[out.request_id].append(out)
    finally:
        engine.shutdown()

    def described(out):
        c = out.outputs[0]
        named = [(e.token_id, e.token, [(t.token_id, t.token) for t in e.top_logprobs]) for e in c.logprobs]
        return c.text, c.token_ids, c.finish_reason, named, [(e.token_id, e.token) for e in out.prompt_logprobs]

    assert len(seen[streamed.request_id]) == 10 and [o.finished for o in seen[final.request_id]] == [True]
    last, only = seen[streamed.request_id][-1], seen[final.request_id][0]
    assert described(only) == described(last) and all(e.token for e in only.outputs[0].logprobs)
    # The engine's own outputs (the server's) keep the prompt's first token, unscored, for echo to show.
    first = only.prompt_logprobs[0]
    assert (first.token_id, first.logprob, first.top_logprobs) == (9, None, []) and first.token
    assert [e.logprob for e in only.outputs[0].logprobs] == pytest.approx([e.logprob for e in last.outputs[0].logprobs])


def test_chat_prompt_is_checked_in_one_place(tiny_random):
    with LLM(tiny_random, max_model_len=256) as llm:
        messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"},
                    {"role": "assistant", "content": "hello"}, {"role": "tool", "content": "42"}]
        ids = llm.llm_engine.inputs.chat_prompt(messages)
        assert ids == llm.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                        return_dict=False)
        for bad, field in [([{"role": "robot", "content": "x"}], r"messages\[0\].role='robot'"),
                           ([{"role": "user", "content": 3}], r"messages\[0\].content"),
                           ([], "messages is empty"), (["hi"], r"messages\[0\] must be an object")]:
            with pytest.raises(ValueError, match=field):
                llm.llm_engine.inputs.chat_prompt(bad)
        with pytest.raises(ValueError, match=r"conversation 1: messages\[0\].role"):
            llm.chat([[{"role": "user", "content": "hi"}], [{"role": "robot", "content": "x"}]], greedy())
        assert llm.stats()["num_free_blocks"] == llm.stats()["num_total_blocks"]


def test_shutdown_is_idempotent_and_keeps_the_heap_frozen_for_other_engines(tiny_random):
    import gc
    import weakref

    first = LLMEngine(EngineConfig(model=tiny_random, max_model_len=256))
    second = LLMEngine(EngineConfig(model=tiny_random, max_model_len=256))
    worker = weakref.ref(first.executor.worker)
    first.shutdown()
    first.shutdown()
    assert worker() is None  # freed at once, though the heap is still frozen
    assert gc.get_freeze_count() > 0  # `second` still runs: its start-up heap stays out of the collector's sight
    second.shutdown()


def test_the_engine_and_its_asyncio_wrapper_import_without_ray_or_grpc():
    # The GPU machine has neither: scripts there drive AsyncEngine and LLM in process.
    import subprocess
    import sys

    code = ("import sys, pagedserve.engine.async_engine, pagedserve.llm; "
            "print(sorted({'ray', 'grpc'} & set(sys.modules)))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_priority_scheduling_runs_the_urgent_first_with_the_same_tokens(tiny_random, reference, async_scheduling):
    config = dict(max_model_len=256, max_num_seqs=2, async_scheduling=async_scheduling)
    with LLM(tiny_random, scheduling_policy="priority", **config) as llm:
        engine = llm.llm_engine
        for i in range(3):
            engine.add_request([9, 8, 7], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, priority=1),
                               f"batch{i}")
        engine.step()
        engine.add_request([5, 6, 7, 8], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), "urgent")
        finished: list[str] = []
        outputs = {}
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    finished.append(out.request_id)
                    outputs[out.request_id] = out.outputs[0].token_ids
        # it came last, after a step, into a full batch: it preempted the batch request admitted last, and
        # ended before it and the one still waiting (first come, first served, it would have ended last)
        assert finished.index("urgent") < min(finished.index("batch1"), finished.index("batch2"))
        assert engine.scheduler.num_preemptions >= 1
        assert outputs.pop("urgent") == reference[(5, 6, 7, 8)]
        assert all(ids == reference[(9, 8, 7)] for ids in outputs.values()) and len(outputs) == 3
        assert engine.block_manager.num_free_blocks == engine.block_manager.num_total_blocks
    with LLM(tiny_random, **config) as fcfs:
        with pytest.raises(ValueError, match="priority=1 needs scheduling_policy='priority'"):
            fcfs.generate([[1, 2]], SamplingParams(priority=1))
    with pytest.raises(ValueError, match="scheduling_policy='urgent' must be one of"):
        EngineConfig(scheduling_policy="urgent")


def test_a_request_reports_the_prompt_tokens_the_prefix_cache_held(tiny_random):
    llm = LLM(tiny_random, block_size=16)
    prompt = list(range(5, 55))  # 50 tokens: three full blocks
    params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    try:
        assert llm.generate(prompt, params)[0].num_cached_tokens == 0
        before = llm.stats()["prefix_cache_hits"]
        again = llm.generate(prompt, params)[0]
        assert again.num_cached_tokens == llm.stats()["prefix_cache_hits"] - before == 48
    finally:
        llm.shutdown()


def test_a_request_is_prepared_off_the_event_loop_while_the_streams_go_on(tiny_random):
    """A request's preparation (here made to last until a running stream has had three more outputs) runs
    beside the step loop: on the event loop it would hold the loop, the stream could not move, and the
    preparation would wait in vain. Requests prepared meanwhile keep their order, and nothing leaks."""
    import threading

    async def main():
        core = AsyncEngine(EngineConfig(model=tiny_random, max_model_len=256))
        try:
            running = core.generate([9, 8, 7], greedy(200), request_id="running")
            await anext(running)
            moved = threading.Event()
            make_request = core.llm_engine.inputs.make
            prepared: list[str] = []

            def slow_make_request(prompt, params, request_id=None, lora_request=None):
                if request_id == "slow":
                    assert moved.wait(timeout=30), "the running stream stood still while a request was prepared"
                prepared.append(request_id)
                return make_request(prompt, params, request_id, lora_request)

            core.llm_engine.inputs.make = slow_make_request

            async def read_running():
                seen = 0
                async for _ in running:
                    seen += 1
                    if seen == 3:
                        moved.set()

            async def collect(prompt, request_id):
                return [out async for out in core.generate(prompt, greedy(12), request_id)][-1]

            reader = asyncio.create_task(read_running())
            slow, after = await asyncio.gather(collect([5, 6, 7, 8], "slow"), collect([9, 8, 7], "after"))
            core.abort("running")
            await reader
            return slow, after, prepared, core.stats()
        finally:
            core.shutdown()

    slow, after, prepared, stats = asyncio.run(main())
    assert slow.finished and after.finished and prepared == ["slow", "after"]
    assert stats["num_streams"] == 0 and stats["num_free_blocks"] == stats["num_total_blocks"]


def test_a_tokenizer_that_carries_truncation_settings_never_truncates_a_prompt(tmp_path, tiny_random):
    """A tokenizer.json may set truncation and padding; the engine clears both as it loads the tokenizer
    (transformers' encode would clear them on its first call, changing the Rust tokenizer in place while the
    step loop's thread may be decoding with it), and a prompt longer than the setting is kept whole."""
    import json
    import shutil

    src = tiny_random.removeprefix("random:").rsplit("/", 1)[0]
    shutil.copytree(src, tmp_path, dirs_exist_ok=True)
    spec = json.loads((tmp_path / "tokenizer.json").read_text())
    spec["truncation"] = {"direction": "Right", "max_length": 8, "strategy": "LongestFirst", "stride": 0}
    spec["padding"] = {"strategy": {"Fixed": 64}, "direction": "Right", "pad_to_multiple_of": None, "pad_id": 0,
                       "pad_type_id": 0, "pad_token": "<|endoftext|>"}
    (tmp_path / "tokenizer.json").write_text(json.dumps(spec))
    engine = LLMEngine(EngineConfig(model=f"random:{tmp_path / 'config.json'}", max_model_len=256))
    try:
        backend = engine.tokenizer._tokenizer
        assert backend.truncation is None and backend.padding is None
        text = "one two three four five six seven eight nine ten eleven twelve"
        ids = engine.inputs.encode_prompt(text)
        assert len(ids) > 8 and engine.tokenizer.decode(ids) == text
    finally:
        engine.shutdown()


def test_requests_being_prepared_count_toward_the_waiting_bound(tiny_random):
    """Requests that arrive together are all prepared on the preparing thread before any is queued: they count
    as waiting from the moment they pass the bound, so max_waiting_requests still refuses the ones beyond it."""
    from pagedserve.engine.async_engine import QueueFull

    async def main():
        core = AsyncEngine(EngineConfig(model=tiny_random, max_model_len=256), max_waiting_requests=2)
        try:
            async def one(i):
                try:
                    return [out async for out in core.generate([9, 8, 7, i], greedy(4))][-1]
                except QueueFull as e:
                    return e
            return await asyncio.gather(*(one(i) for i in range(6))), core.stats()
        finally:
            core.shutdown()

    results, stats = asyncio.run(main())
    refused = [r for r in results if isinstance(r, QueueFull)]
    assert len(refused) == 4 and "max_waiting_requests=2" in str(refused[0])
    assert all(r.finished for r in results if not isinstance(r, QueueFull))
    assert stats["num_free_blocks"] == stats["num_total_blocks"]


def test_an_llm_dropped_without_shutdown_frees_its_model_and_kv_pool(tiny_random):
    """The engine keeps its start-up heap frozen out of the collector's sight while it runs: an LLM dropped without
    shutdown() must still let go of its KV pool and model, or each one left behind holds them until exit."""
    import gc
    import weakref

    llm = LLM(tiny_random, kv_cache_memory="8MiB")
    llm.generate([[1, 2, 3]], greedy(2))
    worker = llm.llm_engine.executor.worker
    pool, model = weakref.ref(worker.runner.kv_pool), weakref.ref(worker.model)
    del llm, worker
    gc.collect()
    assert pool() is None and model() is None
