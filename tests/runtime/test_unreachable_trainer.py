"""A trainer UCX cannot connect to for a while (issue 47): the reader tries again with a new agent within the sync,
names the trainer once, and never gives up for good while the trainer lives."""

from __future__ import annotations

import gc
import logging
import threading

import pytest

from weightplan.runtime import SyncError, load_plan
from weightplan.runtime.transport import protocol
from weightplan.runtime.transport.nixl_agent import NixlAgent
from weightplan.testing.runtime_worker import full_weights, shard

from ..support.pairs import assert_equal_to_host, in_process_pair


@pytest.fixture
def bf16_plan(plan_cache):
    return load_plan(plan_cache("tiny-glm", "hf", "bf16", "fsdp=1", "tp=1"))


def _refusing_metadata(rendezvous) -> bytes:
    """Metadata naming the trainer's agent whose UCX worker is gone: connecting to it is refused (nothing listens)."""
    gone = NixlAgent(protocol.trainer(0).agent(rendezvous.job))
    metadata = gone.metadata()
    gone.close()
    del gone
    gc.collect()  # destroy its worker, closing its listening socket
    return metadata


def test_a_trainer_refusing_connections_for_a_moment_is_read_within_the_same_sync(rendezvous, bf16_plan, caplog):
    """The trainer's published metadata first points at a worker that is gone (UCX: connection refused), then, 1.5 s
    into the sync, at the trainer's live agent again: the sync completes with the host executor's bytes, the refusal
    logged once, naming the trainer rank."""
    tensors, sender, destination, receiver = in_process_pair(bf16_plan, rendezvous)
    key = protocol.trainer(0).metadata_key(sender.incarnation)
    live = sender.agent.metadata()
    rendezvous.put(key, _refusing_metadata(rendezvous))
    sender.publish(1)
    restore = threading.Timer(1.5, rendezvous.put, (key, live))
    restore.start()
    try:
        with caplog.at_level(logging.WARNING, logger="weightplan.runtime"):
            report = receiver.sync(1)
    finally:
        restore.join()
    assert report.version == 1 and receiver.version == 1 and report.connect_seconds >= 1.0
    assert_equal_to_host(bf16_plan, destination, 1)
    refused = [r.getMessage() for r in caplog.records if "cannot load agent metadata" in r.getMessage()]
    assert len(refused) == 1 and "trainer rank 0" in refused[0], refused


def test_a_trainer_never_reachable_fails_the_sync_naming_it_and_the_next_sync_tries_again(rendezvous, bf16_plan):
    """Refused for the whole sync: it fails naming the trainer rank, the address it reaches the store from, its
    incarnation and its agent, and reports no version; once the trainer's live metadata is back, the next sync reads
    it."""
    tensors, sender, destination, receiver = in_process_pair(bf16_plan, rendezvous)
    key = protocol.trainer(0).metadata_key(sender.incarnation)
    live = sender.agent.metadata()
    rendezvous.put(key, _refusing_metadata(rendezvous))
    sender.publish(1)
    with pytest.raises(SyncError, match=r"trainer rank 0 at 127\.0\.0\.1 \(incarnation [0-9a-f]{8}\): cannot load "
                                        r"agent metadata published for '.*trainer\.0'"):
        receiver.sync(1)
    assert receiver.version is None
    rendezvous.put(key, live)
    sender.release(1, timeout=0.5)
    for name, value in shard(bf16_plan, full_weights(bf16_plan, 0, 2), 0).items():
        tensors[name].copy_(value)
    sender.publish(2)
    assert receiver.sync(2).version == 2
    assert_equal_to_host(bf16_plan, destination, 2)
