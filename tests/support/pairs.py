"""One trainer rank and one inference rank of a one-to-one plan in this process, and the check of what landed."""

from __future__ import annotations

from weightplan.runtime import Receiver, Sender
from weightplan.runtime.tables.ring import DEFAULT_RING_BYTES
from weightplan.testing.runtime_worker import byte_equal, full_weights, host_reference, plain_destination, shard


def in_process_pair(plan, rendezvous, version=1, ring_bytes=DEFAULT_RING_BYTES, **receiver_kwargs):
    """(the trainer's tensors at `version`, its started Sender, the receiver's destination, its started Receiver)."""
    tensors = shard(plan, full_weights(plan, 0, version), 0)
    # Both agents live in this process, so the target side needs NIXL's progress thread.
    sender = Sender(plan, 0, tensors, rendezvous=rendezvous, timeout=5, verify=True, progress="thread",
                    ring_bytes=ring_bytes).start()
    destination = plain_destination(plan, 0)
    receiver = Receiver(plan, 0, destination, rendezvous=rendezvous, timeout=5, derived="caller", ring_bytes=ring_bytes,
                        **receiver_kwargs).start()
    return tensors, sender, destination, receiver


def assert_equal_to_host(plan, destination, version):
    """`destination` holds what the host executor writes for the trainer's weights of `version`."""
    expected = host_reference(plan, full_weights(plan, 0, version), 0)
    assert expected and all(byte_equal(t, destination[n]) for n, t in expected.items())
