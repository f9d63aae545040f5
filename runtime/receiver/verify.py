"""The verify=True post-op: each group's landed bytes compared with the digests the trainers published for the version."""

from __future__ import annotations

import time

import torch

from ..errors import SyncError
from ..plan.format import Plan
from ..tables.ranks import Reads
from ..transport import protocol
from ..transport.region_digests import byte_view, run_digests
from ..transport.rendezvous import Rendezvous


class Verifier:
    """Checks inference rank's landed bytes: `reads` by trainer rank and their pipeline `groups` (runtime/tables/receiver.py
    `read_groups`), `hop_reads` the trainers' runs into the entries read from pullers of this node (fan-out), `quant`
    the rank's ReceiverQuant (its fp8 blocks' digests) or None. `start` loads one version's digests, then each call
    checks a group, and check("second hops") the entries read from pullers; `seconds` is the time spent checking."""

    def __init__(self, plan: Plan, rendezvous: Rendezvous, reads: dict[int, Reads], groups, hop_reads: dict[int, Reads],
                 quant):
        self.plan, self.rendezvous, self._reads, self._groups, self._hop_reads, self._quant = (
            plan, rendezvous, reads, groups, hop_reads, quant)
        self.seconds = 0.0
        self._theirs: dict[int, dict] = {}
        self._buffers: dict[int, torch.Tensor] = {}

    def start(self, version: int, deadline: float, trainers: list[int], destinations: dict[int, torch.Tensor]) -> None:
        """Wait for and load `version`'s digests of `trainers` (and of the trainers behind second hops); the bytes to
        check land in `destinations` (one destination set's views by plan entry)."""
        trainers = sorted(set(trainers) | set(self._hop_reads))
        self.rendezvous.wait([protocol.digests_key(r, version) for r in trainers], deadline - time.monotonic(),
                             "trainer digests (start trainers with verify=True)")
        self._theirs = {r: self.rendezvous.get_json(protocol.digests_key(r, version)) for r in trainers}
        self._buffers = {d: byte_view(t) for d, t in destinations.items()}
        self.seconds = 0.0

    def __call__(self, group) -> None:
        began = time.perf_counter()
        bad = []
        hops = group == "second hops"
        for rank, reads in (self._hop_reads if hops else self._reads).items():
            part = reads if hops else reads.take(self._groups.groups[rank] == group)
            ours = {str(d): h for d, h in run_digests(self._buffers, part.dest, part.dst_byte, part.dst_stride, part).items()}
            if not hops and self._quant and rank in self._quant.rows:
                ours.update(self._quant.digests(rank, group))
            bad += [f"{self._key_name(k)} (from trainer rank {rank})" for k, h in ours.items()
                    if self._theirs[rank].get(k) != h]
        self.seconds += time.perf_counter() - began
        if bad:
            raise SyncError(f"verification failed for {len(bad)} regions, e.g. {', '.join(bad[:3])}")

    def _key_name(self, key: str) -> str:
        return self.plan.dests[int(key)].name if key.isdigit() else self._quant.key_name(key)
