"""The ingress's retry of a request whose replica failed it: run again while nothing of it reached the client,
whichever way Ray reports the replica gone; ended once something did. (The same on a real Serve app, with a
replica killed under load: tests/serving/test_prefix_routing.py.)"""

from __future__ import annotations

import asyncio

import pytest
from ray.exceptions import ActorDiedError, ActorUnavailableError

from pagedserve.sampling_params import SamplingParams
from pagedserve.serving.deltas import Delta
from pagedserve.serving.model_client import ModelClient


class _Stream:
    """One call's streamed deltas; an exception among them is raised where it stands."""

    def __init__(self, items: list) -> None:
        self.items = items

    def __aiter__(self):
        return self._run()

    async def _run(self):
        for item in self.items:
            if isinstance(item, Exception):
                raise item
            yield item

    def cancel(self) -> None:
        pass


class _Replicas:
    """Stands in for the ModelServer handle: call i streams `runs[i]`."""

    def __init__(self, runs: list[list]) -> None:
        self.runs = runs
        self.calls = 0

    def options(self, stream: bool) -> _Replicas:
        return self

    @property
    def generate_deltas(self) -> _Replicas:
        return self

    def remote(self, prompt, params, request_id, prompt_ids=False, lora=None) -> _Stream:
        self.calls += 1
        return _Stream(self.runs[self.calls - 1])


def _collect(client: ModelClient) -> list[Delta]:
    async def run() -> list[Delta]:
        return [d async for d in client.deltas([1, 2, 3], SamplingParams(max_tokens=2), "r")]
    return asyncio.run(run())


def _done(text: str) -> Delta:
    return Delta("r", 0, text, [7], finish_reason="length", final=True)


@pytest.mark.parametrize("gone", [ActorDiedError(), ActorUnavailableError("connection lost", None)],
                         ids=["died", "unavailable"])
def test_a_request_failed_before_its_first_delta_runs_again(gone):
    replicas = _Replicas([[gone], [gone], [_done("ok")]])
    assert [d.text for d in _collect(ModelClient(replicas))] == ["ok"]
    assert replicas.calls == 3


def test_a_request_runs_at_most_three_times():
    replicas = _Replicas([[ActorUnavailableError("connection lost", None)]] * 4)
    with pytest.raises(ActorUnavailableError):
        _collect(ModelClient(replicas))
    assert replicas.calls == 3


def test_a_request_that_sent_a_delta_ends_with_its_replica():
    replicas = _Replicas([[Delta("r", 0, "a", [5]), ActorUnavailableError("connection lost", None)], [_done("b")]])
    seen: list[str] = []

    async def run() -> None:
        async for d in ModelClient(replicas).deltas([1], SamplingParams(max_tokens=2), "r"):
            seen.append(d.text)

    with pytest.raises(ActorUnavailableError):
        asyncio.run(run())
    assert seen == ["a"] and replicas.calls == 1  # never run twice where the client has part of it



def test_a_batch_of_prompts_is_numbered_and_counted_as_one_request():
    from pagedserve.serving.deltas import merge_prompts, usage

    closed: list[str] = []  # the prompts' streams whose cleanup ran

    async def prompt(i: int, prompt_tokens: int, fail: bool = False):
        try:
            for j in range(2):  # n=2: sample 0 then sample 1, one token each
                yield Delta(f"r-{i}", j, "x", [j], usage=usage(prompt_tokens, j + 1), final=j == 1,
                            prompt_token_ids=[i] * prompt_tokens if j == 0 else None)
                await asyncio.sleep(0)
                if fail:
                    raise ValueError("prompt: too long")
        finally:
            closed.append(f"prompt {i}")

    async def endless():
        try:
            while True:
                await asyncio.sleep(0.01)
                yield Delta("r-1", 0, "", [])
        finally:
            closed.append("endless")

    async def run(streams):
        return [d async for d in merge_prompts(streams, 2, "r")]

    out = asyncio.run(run([prompt(0, 3), prompt(1, 5)]))
    assert sorted((d.index, d.token_ids) for d in out) == [(0, [0]), (1, [1]), (2, [0]), (3, [1])]
    assert {d.request_id for d in out} == {"r"} and [d.final for d in out] == [False, False, False, True]
    assert out[-1].usage == usage(8, 4)
    assert [d.prompt_token_ids for d in out if d.index in (0, 2)] == [[0] * 3, [1] * 5]
    # a prompt that fails ends the batch, and the prompt still running is closed with it
    closed.clear()
    with pytest.raises(ValueError, match="too long"):
        asyncio.run(run([prompt(0, 3, fail=True), endless()]))
    assert sorted(closed) == ["endless", "prompt 0"]


def test_an_event_stream_closes_what_it_reads_when_the_client_leaves():
    from pagedserve.serving.ingress import _EventStream

    closed: list[str] = []

    async def deltas():
        try:
            while True:
                await asyncio.sleep(0)
                yield Delta("r", 0, "x", [1])
        finally:
            closed.append("deltas")  # a request's stream: its cleanup aborts the request

    async def events(source):
        try:
            async for d in source:
                yield f"data: {d.text}\n\n"
        finally:
            closed.append("events")

    async def send(message) -> None:
        if message["type"] == "http.response.body":
            raise OSError("the client left")

    async def run() -> None:
        source = deltas()
        with pytest.raises(OSError):
            await _EventStream(events(source), source).stream_response(send)

    asyncio.run(run())
    assert closed == ["events", "deltas"]  # now, not when the garbage collector comes round
