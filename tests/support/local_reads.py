"""One trainer and one reader in this process, reading it directly (process_vm_readv) or over NIXL: the pair, its
job secret and fixtures, and a CUDA IPC share record, for the same-node read tests."""

from __future__ import annotations

import logging
from contextlib import contextmanager

import pytest

from weightplan.runtime import Receiver, Rendezvous, Sender, load_plan
from weightplan.runtime.transport import protocol
from weightplan.runtime.transport.local_record import CudaShare

from weightplan.testing.runtime_worker import byte_equal, full_weights, host_reference, plain_destination, shard

SECRET = "weightplan-local-reads-test-secret"  # a Receiver reads trainers of its host directly only in a job with one


@pytest.fixture
def rendezvous(request):
    """A store on a free loopback port, namespaced by the test's name, in a job with a secret."""
    return Rendezvous.connect(f"local-{request.node.name[:40].replace('[', '-').replace(']', '')}", "127.0.0.1:0",
                              serve=True, secret=SECRET)


@pytest.fixture
def bf16_plan(plan_cache):
    return load_plan(plan_cache("tiny-glm", "hf", "bf16", "fsdp=1", "tp=1"))


@contextmanager
def pair(plan, rendezvous, tamper=None, delta=0.0, **receiver_kwargs):
    """A Sender and a Receiver in this process (process_vm_readv reads this very process), version 1 published; `tamper`
    edits the trainer's published info before the receiver reads it. Both are closed on leaving."""
    sender = Sender(plan, 0, shard(plan, full_weights(plan, 0, 1), 0), rendezvous=rendezvous, timeout=5,
                    progress="thread", delta=delta).start()
    destination = plain_destination(plan, 0)
    receiver = Receiver(plan, 0, destination, rendezvous=rendezvous, timeout=2, derived="caller", delta=delta,
                        **receiver_kwargs).start()
    if tamper is not None:
        info = rendezvous.get_json(protocol.trainer_info_key(0))
        tamper(info)
        rendezvous.put(protocol.trainer_info_key(0), info)
    sender.publish(1)
    try:
        yield sender, destination, receiver
    finally:
        sender.close()
        receiver.close()


def equal_to_host(plan, destination) -> None:
    expected = host_reference(plan, full_weights(plan, 0, 1), 0)
    assert expected and all(byte_equal(t, destination[n]) for n, t in expected.items())


def read_over_nixl(plan, rendezvous, tamper, caplog) -> str:
    """Sync version 1 with the trainer's info edited by `tamper`: every byte comes over NIXL, equal to the host
    executor's; returns the one warning saying why."""
    caplog.set_level(logging.WARNING, "weightplan.runtime")
    with pair(plan, rendezvous, tamper) as (_, destination, receiver):
        report = receiver.sync(1)
        assert report.paths == {"nixl": report.bytes}
        equal_to_host(plan, destination)
    said = [r.getMessage() for r in caplog.records if "over NIXL, not directly" in r.getMessage()]
    assert len(said) == 1 and "\n" not in said[0], said
    return said[0]


def cuda_share(**changes) -> CudaShare:
    fields = dict(address=0x7F00_0000_0000, nbytes=2 << 20, uuid="GPU-58a2a6a8-1f0c-4c4e-9d0e-3c1f2a6b7e10", device=3,
                  handle=bytes(range(64)), offset=4096, ref_counter=b"/torch_4242_3735928559_0", ref_offset=7,
                  event=bytes(range(64, 128)), event_sync=True)
    return CudaShare(**{**fields, **changes})
