"""The inference rank's delta of a version: READ each trainer's page index, then the blobs of its pages, decode, apply."""

from __future__ import annotations

import hashlib
import logging
from dataclasses import dataclass

import numpy as np
import torch

from ..delta.apply import (KeyedTargets, RefusedBlob, Writes, apply_writes, decode_all, destination_list, keyed_targets,
                           page_keys, warm_up, writes_of)
from ..delta.encode import DeltaError
from ..delta.pages import Pages, Space, Targets, delta_pages, needed_pages, targets
from ..delta.path import delta_path
from ..delta.rates import DeltaChoice, DeltaRates, choose
from ..errors import PlanMismatchError, SyncError
from ..plan.format import Plan
from ..tables.quant import QuantTables
from ..tables.receiver import ReadTables
from ..transport.reader import PeerReader, Transport
from ..transport.peer import Peer
from ..transport import protocol
from ..transport.protocol import DeltaRecord, TrainerInfo
from ..transport.region_digests import byte_view

log = logging.getLogger("weightplan.runtime")
INDEX_WORDS = 3  # as runtime/sender/delta.py writes it: version, base, page count, then each page blob's end


@dataclass(frozen=True)
class TrainerPages:
    """What this rank takes from one trainer rank's deltas: its pages, the ones it needs, where their bytes land."""

    pages: Pages
    need: np.ndarray  # rows of `pages` some of this rank's delta-able descriptors read
    targets: Targets
    keys: np.ndarray  # page_keys(pages)
    keyed: KeyedTargets  # targets in key order
    deltable: np.ndarray  # over the trainer's READ descriptors: replaced by the delta when one is taken
    staging: torch.Tensor  # the blobs of the needed pages land here
    index: torch.Tensor  # the trainer's page index lands here


@dataclass(frozen=True)
class DeltaSource:
    """One trainer incarnation's delta areas, as its info published them and this rank checked them."""

    index_read: object  # the prepared READ of its page index
    region: int  # address of its delta region
    capacity: int


@dataclass(frozen=True)
class Fetched:
    """The deltas this rank read for one version: the writes by trainer rank, the trainers whose delta did not fit this
    rank's staging (they are read full), and the bytes READ."""

    writes: dict[int, Writes]
    too_large: tuple[int, ...]
    nbytes: int
    by_rank: dict[int, int]  # `nbytes` by trainer rank
    choices: tuple[DeltaChoice, ...] = ()  # one per trainer whose delta fit: taken, or declined as slower than full


class ReceiverDelta:
    """Inference `rank`'s side of delta syncs: per trainer rank it reads, its pages and targets (runtime/delta/pages.py)
    and a registered staging of `fraction` of its needed pages' bytes. A version's delta from one trainer that does not
    fit that staging is read full from that trainer."""

    def __init__(self, plan: Plan, rank: int, tables: QuantTables | None, ring_bytes: int, read: ReadTables,
                 destinations: dict[int, torch.Tensor], fraction: float, path: str = "auto",
                 rates: DeltaRates | None = None):
        if not 0 < fraction <= 1:
            raise ValueError(f"delta={fraction}: give the fraction of the read bytes the delta staging holds, in (0, 1]")
        # host: numba kernels; device: the Triton kernels on the destinations' device, staging there too
        self.path, device = delta_path(destinations.values(), path, f"inference rank {rank}")
        self.rates = rates or DeltaRates.from_env()
        bases = np.full(len(plan.dests), -1, dtype=np.int64)
        sizes = np.zeros(len(plan.dests), dtype=np.int64)
        for entry, t in destinations.items():
            bases[entry], sizes[entry] = t.data_ptr(), t.numel() * t.element_size()
        self.rank = rank
        self._entry_bytes = sizes
        if self.path == "device":
            from ..delta import device as codec

            self._codec = codec
            base = min(destinations.values(), key=lambda t: t.data_ptr()) if destinations else torch.zeros(1)
            self._base = base.detach().reshape(-1).view(torch.uint8)
            self._entry_at = torch.as_tensor(np.where(bases >= 0, bases - self._base.data_ptr(), 0), device=device)
            self._entry_bytes_on = torch.as_tensor(sizes, device=device)
        else:
            self._views = destination_list({entry: byte_view(t) for entry, t in destinations.items()}, len(plan.dests))
        self.trainers: dict[int, TrainerPages] = {}
        for src, d in read.descriptors.items():
            deltable, found = targets(d.region, d.remote_off, d.nbytes, d.local, d.chunk, bases, sizes)
            pages = delta_pages(plan, src, tables, ring_bytes)
            need = needed_pages(pages, found)
            keyed = keyed_targets(pages, found)
            self.trainers[src] = TrainerPages(pages, need, found, page_keys(pages),
                                              self._codec.keyed_on(keyed, device) if self.path == "device" else keyed,
                                              deltable, torch.zeros(max(int(fraction * pages.nbytes[need].sum()), 64),
                                                                    dtype=torch.uint8, device=device),
                                              torch.zeros(INDEX_WORDS + len(pages), dtype=torch.int64))
        self._index_local: dict[int, object] = {}

    @property
    def registered(self) -> list[torch.Tensor]:
        return [t for p in self.trainers.values() for t in (p.staging, p.index)]

    @property
    def staging_bytes(self) -> int:
        return sum(p.staging.numel() + p.index.numel() * 8 for p in self.trainers.values())

    def start(self, agent: Transport) -> None:
        if self.path == "host":
            warm_up()
        self._index_local = {src: agent.prepare(None, np.array([[p.index.data_ptr(), p.index.numel() * 8]]))
                             for src, p in self.trainers.items()}

    def release(self, agent: Transport) -> None:
        for prepared in self._index_local.values():
            agent.release_list(prepared)

    def connect(self, rank: int, peer: Peer, info: TrainerInfo) -> DeltaSource | None:
        """Trainer `rank`'s delta areas from its checked info; None when it keeps no deltas."""
        if info.delta is None:
            return None
        (index_addr, index_bytes), (region, capacity) = info.delta["index"], info.delta["region"]
        p = self.trainers[rank]
        if index_bytes != p.index.numel() * 8:
            raise PlanMismatchError(f"trainer rank {rank} indexes {index_bytes // 8 - INDEX_WORDS} delta pages, this rank "
                                    f"expects {len(p.pages)}: give both sides the same plan and ring_bytes")
        if capacity:  # its blobs are READ from lists prepared per sync: memory it did not register is refused now
            peer.prepare(np.array([[region, capacity]]), fields={"delta.region": (region, capacity)})
        return DeltaSource(peer.word(self._index_local[rank], index_addr, index_bytes, "delta.index"), region, capacity)

    def fetch(self, agent: PeerReader, sources: dict[int, tuple[Peer, DeltaSource, DeltaRecord]], version: int,
              deadline: float, full_bytes: dict[int, int]) -> Fetched:
        """READ the index, then the needed blobs, of every trainer in `sources` whose delta is predicted faster than
        reading its `full_bytes[rank]` (runtime/delta/rates.py), and decode them all: a SyncError naming the trainer and
        page for anything inconsistent, before any destination byte is written."""
        agent.read_now([(s.index_read, f"trainer rank {r}") for r, (_, s, _) in sources.items()], deadline,
                       f"version {version}: reading delta indexes")
        reads, too_large, by_rank, choices = {}, [], {}, []
        for rank, (peer, source, record) in sources.items():
            ends = self._checked_index(rank, source, record, version)
            p = self.trainers[rank]
            begin = np.concatenate([[0], ends[:-1]])
            rows = np.flatnonzero(p.need & (ends > begin))
            lengths = ends[rows] - begin[rows]
            by_rank[rank] = 8 * (INDEX_WORDS + len(p.pages))  # the index, read whatever is chosen
            if lengths.sum() > p.staging.numel():
                too_large.append(rank)
                continue
            blobs = int(lengths.sum())
            choices.append(choose(self.rates, rank, self.path, record.density, blobs, full_bytes[rank], blobs))
            if not choices[-1].taken:
                continue
            local = np.cumsum(lengths) - lengths
            # blobs of consecutive needed pages continue each other: one descriptor each such stretch
            first = np.flatnonzero(np.concatenate([[True], begin[rows][1:] != ends[rows][:-1]])) if len(rows) else rows
            sizes = np.add.reduceat(lengths, first) if len(rows) else lengths
            reads[rank] = (peer, rows, begin[rows], lengths, local, first, sizes)
            by_rank[rank] += blobs
        posted = []
        try:
            for rank, (peer, rows, start, lengths, local, first, sizes) in reads.items():
                if not len(rows):
                    continue
                p, source = self.trainers[rank], sources[rank][1]
                remote_list = peer.reader.prepare(peer.name, np.stack([source.region + start[first], sizes], axis=1),
                                                  peer.memory)
                local_list = agent.prepare(None, np.stack([p.staging.data_ptr() + local[first], sizes], axis=1))
                handle = peer.reader.make_read(local_list, remote_list, np.arange(len(first)))
                posted.append((handle, remote_list, local_list, f"trainer rank {rank}"))
                agent.post(handle, f"trainer rank {rank}")
            agent.wait([(h, who) for h, _, _, who in posted], deadline, f"version {version}: reading deltas")
        finally:
            for handle, remote_list, local_list, _ in posted:
                agent.release(handle)
                agent.release_list(remote_list)
                agent.release_list(local_list)
        writes = {rank: self._decoded(rank, rows, lengths, local, version)
                  for rank, (_, rows, _, lengths, local, _, _) in reads.items()}
        return Fetched(writes, tuple(too_large), sum(by_rank.values()), by_rank, tuple(choices))

    def take(self, reader: PeerReader, rendezvous, trainers: dict, version: int, previous: int | None,
             synced: dict[int, str], deadline: float) -> tuple[set[int], dict[int, int], tuple[DeltaChoice, ...]]:
        """Take `version` as a delta from every trainer rank whose delta applies to what this rank holds: its record names
        `previous` as base and this rank's current version came from that same trainer incarnation (`synced`; `trainers`
        are the connections, runtime/receiver/connections.py). Every delta is read and decoded before any is applied (a
        bad one fails the sync with nothing written). Returns the trainer ranks whose delta was applied, the bytes READ
        for each (indexes included) and the choices made; the others are read full, among them those whose delta was
        predicted slower than reading full (runtime/delta/rates.py)."""
        if previous is None:
            return set(), {}, ()
        sources = {}
        for rank, t in trainers.items():
            key = protocol.delta_key(rank, version)
            if t.delta is None or synced.get(rank) != t.peer.incarnation or not rendezvous.exists(key):
                continue
            record = protocol.parse_delta_record(rendezvous.get_json(key), rank, version)
            if record.base == previous:
                sources[rank] = (t.peer, t.delta, record)
        if not sources:
            return set(), {}, ()
        fetched = self.fetch(reader, sources, version, deadline, {r: trainers[r].deltable_bytes for r in sources})
        if fetched.too_large:
            log.info("inference rank %d: the deltas of version %d from trainer ranks %s exceed this rank's delta staging; "
                     "reading them full", self.rank, version, list(fetched.too_large))
        declined = [c.why for c in fetched.choices if not c.taken]
        if declined:
            log.info("inference rank %d: version %d read full where a delta is predicted slower: %s", self.rank, version,
                     "; ".join(declined))
        self.apply(fetched.writes)
        return set(fetched.writes), fetched.by_rank, fetched.choices

    def apply(self, writes: dict[int, Writes]) -> int:
        if self.path == "device":
            return sum(self._codec.apply_writes(w, self._base, self._entry_at) for w in writes.values())
        return sum(apply_writes(w, self._views) for w in writes.values())

    def _checked_index(self, rank: int, source: DeltaSource, record: DeltaRecord, version: int) -> np.ndarray:
        """The page blob ends of trainer `rank`'s index, once it matches its signed record and its region."""
        p = self.trainers[rank]
        index = p.index.numpy()
        what = f"trainer rank {rank}: its delta of version {version}"
        if hashlib.sha256(byte_view(p.index)).hexdigest() != record.index_sha256:
            raise SyncError(f"{what} has a page index that is not the one its record names")
        if index[:INDEX_WORDS].tolist() != [version, record.base, len(p.pages)]:
            raise SyncError(f"{what}: its index says version {index[0]}, base {index[1]}, {index[2]} pages; expected "
                            f"{version}, {record.base}, {len(p.pages)}")
        ends = index[INDEX_WORDS:].astype(np.int64)
        if len(ends) and (ends[0] < 0 or np.any(np.diff(ends) < 0)):
            raise SyncError(f"{what}: its page sizes are not a sequence of blob ends")
        total = int(ends[-1]) if len(ends) else 0
        if total != record.nbytes or total > source.capacity:
            raise SyncError(f"{what}: its pages end at byte {total}, beyond its region of {source.capacity} bytes "
                            f"or not the {record.nbytes} its record names")
        return ends

    def _decoded(self, rank: int, rows: np.ndarray, lengths: np.ndarray, local: np.ndarray, version: int) -> Writes:
        p = self.trainers[rank]
        device = self.path == "device"
        try:
            changes = (self._codec.decode_all(p.staging, local, lengths, rows, p.pages, p.keys) if device else
                       decode_all(byte_view(p.staging), local, lengths, rows, p.pages, p.keys))
        except RefusedBlob as exc:
            row = exc.row
            raise SyncError(f"trainer rank {rank}: its delta of version {version}, page {row} "
                            f"({Space(int(p.pages.space[row])).name.lower()} {int(p.pages.index[row])} at byte "
                            f"{int(p.pages.start[row])}): {exc}") from None
        try:
            if device:
                return self._codec.writes_of(changes, p.keyed, self._entry_bytes_on)
            return writes_of(changes, p.keyed, self._entry_bytes)
        except DeltaError as exc:
            raise SyncError(f"trainer rank {rank}: its delta of version {version}: {exc}") from None
