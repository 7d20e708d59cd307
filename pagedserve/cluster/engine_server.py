"""The engine side of the Serve application: `EngineServer`, one deployment replica per model replica (an
`AsyncEngine`: scheduler, block manager, step loop, and its own worker actors), and `EngineClient`, the
ingress's view of it through a deployment handle."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from typing import Any

from ray import serve
from ray.serve.handle import DeploymentHandle

from pagedserve.async_engine import AsyncEngine
from pagedserve.cluster.deltas import Delta, stream_deltas
from pagedserve.config import EngineConfig, ray_hosted_config
from pagedserve.sampling_params import SamplingParams


@serve.deployment(ray_actor_options={"num_cpus": 0}, max_ongoing_requests=4096, health_check_period_s=10)
class EngineServer:
    def __init__(self, config: EngineConfig, max_waiting_requests: int | None = None) -> None:
        from pagedserve.cluster.metrics import EngineMetrics

        self.core = AsyncEngine(ray_hosted_config(config), max_waiting_requests)
        self.core.metrics = EngineMetrics(self.core.model_info()["model"])

    async def generate_deltas(self, prompt: str | list[int], params: SamplingParams,
                              request_id: str | None = None) -> AsyncIterator[Delta]:
        # Deltas are cut here, on the engine side: only what is new crosses between processes each step.
        async for d in stream_deltas(self.core.generate(prompt, params, request_id), params):
            yield d

    async def chat_prompt(self, messages: list[dict[str, str]]) -> list[int]:
        return self.core.engine.chat_prompt(messages)

    async def tokenize(self, text: str | None, messages: list[dict[str, str]] | None,
                       add_special_tokens: bool) -> tuple[list[int], list[str]]:
        return self.core.engine.tokenize(text, messages, add_special_tokens)

    async def model_info(self) -> dict[str, Any]:
        return self.core.model_info()

    async def stats(self) -> dict[str, Any]:
        return self.core.stats()

    def __del__(self) -> None:
        core = getattr(self, "core", None)
        if core is not None:
            core.shutdown()  # the worker actors and their placement group go with the replica


class EngineClient:
    """What the front ends (gRPC, OpenAI HTTP) share: the `EngineServer` handle (Serve routes each call
    to one of its replicas) and the model's description."""

    def __init__(self, engine: DeploymentHandle, num_replicas: int = 1) -> None:
        self.engine = engine
        self.num_replicas = num_replicas
        self._info: dict[str, Any] | None = None

    async def model_info_dict(self) -> dict[str, Any]:
        if self._info is None:
            self._info = await self.engine.model_info.remote()
        return self._info

    async def deltas(self, prompt: str | list[int], params: SamplingParams,
                     request_id: str | None) -> AsyncIterator[Delta]:
        """The request's deltas (see `stream_deltas`) from whichever engine replica Serve picks."""
        stream = self.engine.options(stream=True).generate_deltas.remote(prompt, params,
                                                                         request_id or uuid.uuid4().hex)
        try:
            async for d in stream:
                yield d
        finally:
            stream.cancel()  # no-op once finished; otherwise the client left: abort and free the blocks
