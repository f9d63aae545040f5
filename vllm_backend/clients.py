"""Adapters giving vLLM's in-process engines the four-method VLLMWeightSyncClient surface the trainer engine drives."""

from __future__ import annotations

import asyncio
import inspect
from typing import Any

from vllm.distributed.weight_transfer.base import WeightTransferInitRequest, WeightTransferUpdateRequest


class LLMClient:
    """A `vllm.LLM` as a VLLMWeightSyncClient (its methods take request objects, the protocol plain dicts)."""

    def __init__(self, llm) -> None:
        self.llm = llm

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        self.llm.init_weight_transfer_engine(WeightTransferInitRequest(init_info=init_info))

    def start_weight_update(self) -> None:
        self.llm.start_weight_update()

    def start_draft_weight_update(self) -> None:
        self.llm.start_draft_weight_update()

    def update_weights(self, update_info) -> None:
        self.llm.update_weights(WeightTransferUpdateRequest(update_info=update_info))

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self.llm.finish_weight_update(**_version_argument(self.llm.finish_weight_update, weight_version))


class AsyncLLMClient:
    """An `AsyncLLM` running on event loop `loop` (another thread) as a VLLMWeightSyncClient.

    Generation is paused (`pause_generation`) from start_weight_update to finish_weight_update,
    so no request runs while the weights change; except after a prefetch (`update_weights` with
    `"prefetch": True`, which only starts the workers' background reads): generation resumes until
    the update that applies the version pauses it again.
    """

    def __init__(self, engine, loop: asyncio.AbstractEventLoop, timeout: float = 600.0) -> None:
        self.engine, self.loop, self.timeout = engine, loop, timeout
        self.resumed_for_prefetch = False

    def _run(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(self.timeout)

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        self._run(self.engine.init_weight_transfer_engine(WeightTransferInitRequest(init_info=init_info)))

    def start_weight_update(self) -> None:
        self._start(self.engine.start_weight_update)

    def start_draft_weight_update(self) -> None:
        self._start(self.engine.start_draft_weight_update)

    def _start(self, start) -> None:
        self._run(self.engine.pause_generation())
        try:
            self._run(start())
        except BaseException:
            self._run(self.engine.resume_generation())
            raise

    def update_weights(self, update_info) -> None:
        prefetch = isinstance(update_info, dict) and update_info.get("prefetch") is True
        if self.resumed_for_prefetch and not prefetch:
            self._run(self.engine.pause_generation())
            self.resumed_for_prefetch = False
        try:
            self._run(self.engine.update_weights(WeightTransferUpdateRequest(update_info=update_info)))
        except BaseException:
            self._run(self.engine.resume_generation())
            raise
        if prefetch:
            self._run(self.engine.resume_generation())
            self.resumed_for_prefetch = True

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self.resumed_for_prefetch = False
        try:
            self._run(self.engine.finish_weight_update(**_version_argument(self.engine.finish_weight_update,
                                                                           weight_version)))
        finally:
            self._run(self.engine.resume_generation())


def _version_argument(finish, weight_version: str | None) -> dict[str, str | None]:
    """`weight_version` for a `finish_weight_update` that takes the version just applied (vLLM 0.30 and 0.32 do; 0.26's
    take nothing)."""
    return {"weight_version": weight_version} if "weight_version" in inspect.signature(finish).parameters else {}


def finish_update(client, version: int) -> None:
    """`client.finish_weight_update`, naming `version` where the client takes it (vLLM 0.26's own clients do not)."""
    client.finish_weight_update(**_version_argument(client.finish_weight_update, str(version)))
