"""The trainer side of the `weightplan` backend: a TrainerWeightTransferEngine wrapping one rank's Sender."""

from __future__ import annotations

import inspect
import logging
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from vllm.distributed.weight_transfer.base import (
    ModuleSource, ParamMeta, TrainerInitInfo, TrainerWeightTransferEngine, WeightSource,
)

from weightplan.runtime import LiveSender, Rendezvous, Sender, load_plan
from weightplan.runtime.transport import protocol

from . import BACKEND
from .clients import finish_update
from .init_info import DRAFT_JOB_SUFFIX

log = logging.getLogger("weightplan.vllm_backend")
# vLLM 0.26: a trainer engine takes the backend's WeightTransferConfig first, in its constructor and trainer_init (base
# class Generic[TConfig, TInitInfo]); 0.30 and 0.32 do not (Generic[TInitInfo]). weightplan reads nothing from it.
TAKES_CONFIG = "config" in inspect.signature(TrainerWeightTransferEngine.trainer_init).parameters


class ShardSource(WeightSource):
    """This trainer rank's local shards: a module (a LiveSender serves its trainer tensors) or {name: local shard}."""

    def __init__(self, tensors) -> None:
        self.tensors = tensors

    def _items(self):
        return self.tensors.named_parameters() if isinstance(self.tensors, torch.nn.Module) else self.tensors.items()

    def metadata(self) -> list[ParamMeta]:
        return [ParamMeta(name, t.dtype, tuple(t.shape)) for name, t in self._items()]

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        yield from self._items()


@dataclass
class WeightplanTrainerInitInfo(TrainerInitInfo):
    """One trainer rank's view of a weightplan job (`rank` is this trainer rank, keyword-only).

    `plan`: this side's plan file; `inference_plan`: the path the inference workers read (default
    the same). `address`/`job`: the rendezvous store and job id; rank 0 hosts the store when
    `serve_store`. `timeout`: seconds for rendezvous, publish and release. `verify`: trainers
    publish digests and receivers check every sync against them. `engine`: extra worker init
    fields passed through (`mode`, `rank_offset`). `draft_plan`: the speculative draft's plan
    (`compile-plan --draft`); with it `trainer_init` takes `draft_source` (this rank's MTP shards)
    and every `send_weights` also updates the engine's draft, in job `job + ".draft"`. `delta`: the delta fraction of
    this rank's Sender and of every inference worker's Receiver (docs/runtime.md, delta syncs; 0: every sync full).
    `drives`: whether this rank drives the engine through `client` (None: rank 0, as vLLM's trainer engines do; an
    engine colocated with a trainer rank, an in-process `vllm.LLM` as TRL's colocate mode runs one per replica, is
    driven by the rank it lives in). Only rank 0 hosts the store either way. `pool_ranks`: the inference ranks this
    rank serves when engine replicas beyond the plan's ranks may join (its Sender's and every worker's `pool_ranks`;
    docs/operations.md#the-pool-grows-and-shrinks; None: the plan's).
    """

    backend: ClassVar[str] = BACKEND

    plan: str = ""
    address: str = "127.0.0.1:29577"
    job: str = "weightplan"
    timeout: float = 60.0
    verify: bool = False
    serve_store: bool = True
    inference_plan: str | None = None
    engine: dict[str, Any] | None = None
    draft_plan: str | None = None
    delta: float = 0.0
    drives: bool | None = None
    pool_ranks: int | None = None

    @property
    def drives_engine(self) -> bool:
        return self.is_sender if self.drives is None else self.drives

    def worker_init_info(self, fingerprint: str) -> dict[str, Any]:
        """The JSON-native init info every inference worker gets."""
        draft = {"draft_plan": self.draft_plan} if self.draft_plan else {}
        delta = {"delta": self.delta} if self.delta else {}
        pool = {} if self.pool_ranks is None else {"pool_ranks": self.pool_ranks}
        return {"plan": self.inference_plan or self.plan, "address": self.address, "job": self.job, "timeout": self.timeout,
                "verify": self.verify, "fingerprint": fingerprint, **draft, **delta, **pool, **(self.engine or {})}


_Base = (TrainerWeightTransferEngine[Any, WeightplanTrainerInitInfo] if TAKES_CONFIG
         else TrainerWeightTransferEngine[WeightplanTrainerInitInfo])


class WeightplanTrainerEngine(_Base):
    """Trainer rank `init_info.rank`'s Sender; rank 0 also drives the inference engine through `client`.

    `send_weights(version=None)` publishes the next version (or `version`) on this rank; rank 0
    then calls start_weight_update, update_weights({"version": v}) and finish_weight_update(
    weight_version=str(v)) on the client; every rank finally releases v (waits for the inference
    ranks' acknowledgements), after which its tensors may change again. With `prefetch=True` rank 0
    first calls update_weights({"version": v, "prefetch": True}) (the workers start reading v in
    the background and the engine keeps generating), and the update that applies v only after
    its own release returned (every inference rank it serves has read v), so the engine's pause
    holds no transfer.

    Under vLLM 0.26 (`TAKES_CONFIG`) `trainer_init` takes that version's arguments, `(config, init_info, ...)`,
    as its `WeightTransferTrainerFactory.trainer_init` passes them; `start_trainer_engine` works under every version.
    """

    init_info_cls = WeightplanTrainerInitInfo

    def __init__(self, *, client, source, is_sender: bool, sender: Sender, rendezvous: Rendezvous,
                 init_info: WeightplanTrainerInitInfo, draft_sender: Sender | None = None, config=None) -> None:
        if TAKES_CONFIG:
            super().__init__(config, client=client, source=source, is_sender=is_sender)
        else:
            super().__init__(client=client, source=source, is_sender=is_sender)
        self.sender, self.rendezvous, self.init_info = sender, rendezvous, init_info
        self.draft_sender = draft_sender
        self.version = 0
        self.last_release = None

    if TAKES_CONFIG:
        @classmethod
        def trainer_init(cls, config, init_info: WeightplanTrainerInitInfo, *, client,
                         source: WeightSource | None = None, draft_source: WeightSource | None = None):
            return cls._trainer_init(init_info, client=client, source=source, draft_source=draft_source, config=config)
    else:
        @classmethod
        def trainer_init(cls, init_info: WeightplanTrainerInitInfo, *, client, source: WeightSource | None = None,
                         draft_source: WeightSource | None = None):
            return cls._trainer_init(init_info, client=client, source=source, draft_source=draft_source)

    @classmethod
    def _trainer_init(cls, init_info: WeightplanTrainerInitInfo, *, client, source: WeightSource | None,
                      draft_source: WeightSource | None, config=None):
        if not isinstance(init_info, WeightplanTrainerInitInfo):
            raise TypeError(f"the weightplan trainer engine needs a WeightplanTrainerInitInfo, got "
                            f"{type(init_info).__name__}")
        tensors = _shards(source, "source")
        if (draft_source is None) != (init_info.draft_plan is None):
            raise TypeError("the weightplan trainer engine needs draft_source (this rank's MTP shards) exactly when "
                            "init_info.draft_plan is given")
        plan = load_plan(init_info.plan)
        serve = init_info.serve_store and init_info.is_sender
        rendezvous = Rendezvous.connect(init_info.job, init_info.address, serve=serve, timeout=init_info.timeout)
        if serve:
            init_info.address = rendezvous.address  # port 0 picks a free one
        sender = _sender(plan, init_info.rank, tensors, rendezvous=rendezvous, timeout=init_info.timeout,
                         verify=init_info.verify, delta=init_info.delta, pool_ranks=init_info.pool_ranks)
        draft_sender = None
        if init_info.draft_plan is not None:
            draft_sender = _sender(load_plan(init_info.draft_plan), init_info.rank, _shards(draft_source, "draft_source"),
                                   rendezvous=Rendezvous.connect(init_info.job + DRAFT_JOB_SUFFIX, init_info.address,
                                                                 timeout=init_info.timeout),
                                   timeout=init_info.timeout, verify=init_info.verify, pool_ranks=init_info.pool_ranks)
        engine = cls(client=client, source=source, is_sender=init_info.drives_engine, sender=sender,
                     rendezvous=rendezvous, init_info=init_info, draft_sender=draft_sender, config=config)
        if init_info.drives_engine and client is not None:
            client.init_weight_transfer_engine(init_info.worker_init_info(plan.fingerprint))
        return engine

    def send_weights(self, version: int | None = None, prefetch: bool = False) -> None:
        """Publish the next version (or `version`) on this rank; rank 0 drives the engine; every rank releases it.

        Rank 0 calls the client on a helper thread while this thread runs `release`: the receivers'
        first READs from a trainer need its NIXL agent to make progress (UCX wire-up), and agents
        here have no progress thread, so the publishing thread must keep polling while the client
        call blocks.
        """
        v = self.version + 1 if version is None else version
        self.sender.publish(v)
        if self.draft_sender is not None:
            self.draft_sender.publish(v)
        failure: list[BaseException] = []
        driver = None
        read = threading.Event() if prefetch else None  # set once this rank's release returned
        if self.is_sender and self.client is not None:
            driver = threading.Thread(target=self._drive, args=(v, failure, read), name=f"weightplan-drive-v{v}", daemon=True)
            driver.start()
        try:
            try:
                self.last_release = self.sender.release(v)
            finally:
                if read is not None:
                    read.set()
            if self.draft_sender is not None:  # the engine takes the draft's update after the target's
                self._await_joins(self.draft_sender, driver)
                self.draft_sender.release(v)
        finally:
            if driver is not None:
                driver.join()
        if failure:
            raise failure[0]
        self.version = v

    def _await_joins(self, sender: Sender, driver: threading.Thread | None) -> None:
        """Wait until the inference ranks reading `sender` have joined (or the driver ended, or the timeout).

        The engine's draft side joins at its first draft update, after the target's; a release
        waits only for the ranks joined when it starts, so releasing earlier would retire the
        version under the joining receivers' first READs.
        """
        keys = [protocol.joined_key(rank) for rank in sender.readers]  # what Receiver.start() publishes
        deadline = time.monotonic() + self.init_info.timeout
        while not all(sender.rendezvous.exists(key) for key in keys):
            if (driver is not None and not driver.is_alive()) or time.monotonic() > deadline:
                return
            time.sleep(0.01)

    def _drive(self, version: int, failure: list, read: threading.Event | None = None) -> None:
        try:
            self.client.start_weight_update()
            if read is not None:
                self.client.update_weights({"version": version, "prefetch": True})
                read.wait()
            self.client.update_weights({"version": version})  # a failure ends the update on the workers
            finish_update(self.client, version)
            if self.draft_sender is not None:
                self.client.start_draft_weight_update()
                self.client.update_weights({"version": version})
                finish_update(self.client, version)
        except BaseException as exc:  # re-raised by send_weights on the caller's thread
            failure.append(exc)

    def shutdown(self) -> None:
        senders, self.sender, self.draft_sender = (self.sender, self.draft_sender), None, None
        for sender in senders:
            if sender is not None:
                sender.close()


def start_trainer_engine(init_info: WeightplanTrainerInitInfo, *, client, source: WeightSource,
                         draft_source: WeightSource | None = None) -> WeightplanTrainerEngine:
    """This rank's trainer engine under any supported vLLM: `WeightplanTrainerEngine.trainer_init` with the arguments
    this version's API takes (0.26: the backend's WeightTransferConfig first)."""
    if TAKES_CONFIG:
        from vllm.config.weight_transfer import WeightTransferConfig

        return WeightplanTrainerEngine.trainer_init(WeightTransferConfig(backend=BACKEND), init_info, client=client,
                                                    source=source, draft_source=draft_source)
    return WeightplanTrainerEngine.trainer_init(init_info, client=client, source=source, draft_source=draft_source)


def _sender(plan, rank: int, tensors, **kwargs) -> Sender | LiveSender:
    """Started: a LiveSender for a module (its trainer tensors, FSDP2 shards and persistent buffers, checked against
    the plan and re-registered if reallocated), else a Sender for {name: local shard}."""
    if isinstance(tensors, torch.nn.Module):
        return LiveSender(plan, rank, tensors, **kwargs).start()
    return Sender(plan, rank, tensors, **kwargs).start()


def _shards(source: WeightSource | None, argument: str):
    """The local shards Sender takes, from a ShardSource or a ModuleSource (its DTensor parameters)."""
    if isinstance(source, ShardSource):
        return source.tensors
    if isinstance(source, ModuleSource):
        return source._module
    raise TypeError(f"the weightplan trainer engine needs {argument}=ShardSource(local shards or module) or "
                    f"ModuleSource(module), got {type(source).__name__}")
