"""The sync protocol between a job's processes: every rendezvous key, agent name and notification message, built and parsed here."""

from __future__ import annotations

import enum
import ipaddress
import logging
import re
from dataclasses import dataclass
from typing import Protocol

from ..errors import SyncError
from .local_record import LocalRecord, parse_local
from .memory import ADDRESS_LIMIT, MemoryMap, check_area

log = logging.getLogger("weightplan.runtime")

# Bump when a key, a record or a message changes meaning: it is in every record's tag and authentication code,
# so processes of different protocol versions refuse each other's records (docs/runtime.md, "The protocol").
PROTOCOL_VERSION = 1
INCARNATION = re.compile(r"[0-9a-f]{32}")  # a Sender's or Receiver's uuid4().hex
TRAINER, INFERENCE = "trainer", "inference"


@dataclass(frozen=True)
class Endpoint:
    """One process of a job as the protocol names it: trainer or inference `rank`."""

    role: str  # TRAINER or INFERENCE
    rank: int

    def __str__(self) -> str:
        return f"{self.role} rank {self.rank}"

    def agent(self, job: str) -> str:
        """Its NIXL agent's name: a reader refuses agent metadata naming any other."""
        return f"{job}.{self.role}.{self.rank}"

    def metadata_key(self, incarnation: str) -> str:
        """Its NIXL agent metadata, one record per process incarnation."""
        return f"{self.role}/{self.rank}/metadata/{incarnation}"

    def info_key(self, incarnation: str) -> str:
        """What readers check and need before loading its agent (trainer_info_key, inference_info_key)."""
        return trainer_info_key(self.rank) if self.role == TRAINER else inference_info_key(self.rank, incarnation)


def trainer(rank: int) -> Endpoint:
    return Endpoint(TRAINER, rank)


def inference(rank: int) -> Endpoint:
    return Endpoint(INFERENCE, rank)


def trainer_info_key(rank: int) -> str:
    """Trainer `rank`'s info: plan fingerprint, incarnation, agent, region addresses. One record, rewritten by a restarted
    process: a reader checks that it names the incarnation the version record gave."""
    return f"trainer/{rank}/info"


def inference_info_key(rank: int, incarnation: str) -> str:
    """A puller's info (fan-out): its landed word and the [entry, address, bytes] its node's peers read, per incarnation."""
    return f"inference/{rank}/info/{incarnation}"


def version_key(rank: int, version: int) -> str:
    """Trainer `rank` published `version` (value: its incarnation); receivers start reading only after it."""
    return f"trainer/{rank}/version/{version}"


def digests_key(rank: int, version: int) -> str:
    """Trainer `rank`'s SHA-256 per destination entry of `version` (a Sender with verify=True; read with verify=True)."""
    return f"trainer/{rank}/digests/{version}"


def staged_key(rank: int, version: int) -> str:
    """Trainer `rank`'s bf16 for `version` is exposed and stable (value: its incarnation), for peers that gather from it."""
    return f"trainer/{rank}/staged/{version}"


def gathered_key(rank: int, version: int) -> str:
    """Trainer `rank` finished reading its peers' bytes of `version`; they may release it."""
    return f"trainer/{rank}/gathered/{version}"


def delta_key(rank: int, version: int) -> str:
    """Trainer `rank`'s delta of `version` (value: `delta_record`), written before its version key when it keeps deltas."""
    return f"trainer/{rank}/delta/{version}"


Area = tuple[int, int]  # (address, bytes) of a registered area


@dataclass(frozen=True)
class ServedRegion:
    """One region a trainer serves in place, as its info names it: the plan source and cast chain, address and bytes
    (address 0: a region served only through the packed region, never read in place)."""

    source: int
    chain: int
    address: int
    nbytes: int


@dataclass(frozen=True)
class SharedOptions:
    """The Sender options its Receivers depend on, published in its info and checked by each Receiver in one place
    (`mismatch`): `ring_bytes` shapes the small-run region and the tables both sides derive from it; `verify`
    says the Sender publishes the digests a Receiver with verify=True checks against; `pool_ranks`, published only
    beyond the plan's ranks, bounds the inference ranks whose acknowledgements it waits for (runtime/options.py)."""

    ring_bytes: int
    verify: bool
    pool_ranks: int | None = None

    def to_json(self) -> dict:
        pool = {} if self.pool_ranks is None else {"pool_ranks": self.pool_ranks}
        return {"ring_bytes": self.ring_bytes, "verify": self.verify, **pool}

    @staticmethod
    def parse(value, who: str) -> "SharedOptions":
        if not isinstance(value, dict) or not {"ring_bytes", "verify"} <= set(value) <= {"ring_bytes", "verify", "pool_ranks"}:
            raise SyncError(f"{who}: its info's 'options' is not an object of ring_bytes, verify and an optional pool_ranks")
        ring = value["ring_bytes"]
        if not isinstance(ring, int) or isinstance(ring, bool) or not 0 < ring < 1 << 62:
            raise SyncError(f"{who}: its info's 'options.ring_bytes' is {str(ring)[:40]}, not a positive byte count")
        if not isinstance(value["verify"], bool):
            raise SyncError(f"{who}: its info's 'options.verify' is {str(value['verify'])[:40]}, not a boolean")
        pool = value.get("pool_ranks")
        if pool is not None and (not isinstance(pool, int) or isinstance(pool, bool) or not 0 < pool < 1 << 31):
            raise SyncError(f"{who}: its info's 'options.pool_ranks' is {str(pool)[:40]}, not a rank count")
        return SharedOptions(ring, value["verify"], pool)

    def mismatch(self, ring_bytes: int, verify: bool, rank: int = 0, plan_ranks: int = 1) -> str | None:
        """What a Receiver with these settings, inference `rank` of a plan of `plan_ranks`, cannot work with, in one
        line naming the option and both values; None when it can."""
        if ring_bytes != self.ring_bytes:
            return (f"ring_bytes is {self.ring_bytes} there and {ring_bytes} here: give its Sender and this Receiver the "
                    "same ring_bytes")
        if verify and not self.verify:
            return "verify is False there and True here: start the trainer with Sender(..., verify=True)"
        pool = self.pool_ranks or plan_ranks
        if rank >= pool:
            return (f"pool_ranks is {pool} there and this is inference rank {rank}: the trainer does not wait for this "
                    f"rank's reads; give every Sender pool_ranks above {rank}")
        return None


@dataclass(frozen=True)
class TrainerInfo:
    """What a trainer rank publishes for readers (trainer_info_key), the one record readers parse: its plan and
    incarnation, its agent, its sequence word, packed and ring regions, served regions, fp8 regions (`quant`: fp8,
    scales, stage_packed), delta index and region (`delta`: index, region as [address, capacity]), where its memory
    lives, what a reader on the same host opens directly (`local`), and the address it reaches the store from (`host`,
    named in a reader's errors when the trainer cannot be reached)."""

    fingerprint: str
    incarnation: str
    agent: str
    seq: int
    packed: Area
    ring: Area  # [address of the ring word, slot bytes]
    regions: tuple[ServedRegion, ...]
    memory: MemoryMap
    options: SharedOptions
    quant: dict[str, Area] | None = None
    delta: dict[str, Area] | None = None
    local: LocalRecord | None = None
    host: str | None = None

    def to_json(self) -> dict:
        return {
            "fingerprint": self.fingerprint, "incarnation": self.incarnation, "agent": self.agent, "seq": self.seq,
            "packed": list(self.packed), "ring": list(self.ring),
            "regions": [[r.source, r.chain, r.address, r.nbytes] for r in self.regions],
            "memory": self.memory.record(), "options": self.options.to_json(),
            **({"quant": {k: list(v) for k, v in self.quant.items()}} if self.quant is not None else {}),
            **({"delta": {k: list(v) for k, v in self.delta.items()}} if self.delta is not None else {}),
            **({"local": self.local.record()} if self.local is not None else {}),
            **({"host": self.host} if self.host is not None else {}),
        }

    @staticmethod
    def parse(value, rank: int) -> "TrainerInfo":
        """The TrainerInfo a store value spells; SyncError naming trainer `rank` and the malformed field otherwise."""
        who = f"trainer rank {rank}"
        if not isinstance(value, dict):
            raise SyncError(f"{who}: its info is not an object")
        unknown = set(value) - _TRAINER_FIELDS
        if unknown:
            raise SyncError(f"{who}: its info has unknown field {sorted(unknown)[0][:40]!r}")
        text = {}
        for key, pattern in (("fingerprint", r"[0-9a-f]{64}"), ("incarnation", INCARNATION.pattern), ("agent", r"[\x21-\x7e]{1,256}")):
            if not isinstance(value.get(key), str) or not re.fullmatch(pattern, value[key]):
                raise SyncError(f"{who}: its info's {key!r} is {str(value.get(key))[:40]}, not a valid {key}")
            text[key] = value[key]
        regions = value.get("regions")
        if not isinstance(regions, list) or len(regions) > MAX_REGIONS or not all(_words(r, 4) for r in regions):
            raise SyncError(f"{who}: its info's 'regions' is not a list of [source, chain, address, bytes]")
        for i, r in enumerate(regions):
            check_area(r[2], r[3], f"regions[{i}]", who)
        (seq,), ring = words(who, value, "seq"), words(who, value, "ring", 2)
        check_area(seq, 8, "seq", who)  # the sequence word
        check_area(ring[0], 16, "ring", who)  # the ring word
        return TrainerInfo(
            **text, seq=seq, packed=check_area(*words(who, value, "packed", 2), "packed", who), ring=tuple(ring),
            regions=tuple(ServedRegion(*r) for r in regions),
            memory=MemoryMap.from_record(value.get("memory"), who), options=SharedOptions.parse(value.get("options"), who),
            quant=_areas(who, value, "quant", ("fp8", "scales", "stage_packed")),
            delta=_areas(who, value, "delta", ("index", "region")), local=parse_local(value.get("local"), who),
            host=_host(who, value.get("host")))


_TRAINER_FIELDS = {"fingerprint", "incarnation", "agent", "seq", "packed", "ring", "regions", "memory", "options", "quant",
                   "delta", "local", "host"}


def _host(who: str, value) -> str | None:
    """A trainer info's 'host': absent (None) or an IP address, else a SyncError naming it."""
    if value is None:
        return None
    try:
        return str(ipaddress.ip_address(value)) if isinstance(value, str) else _bad_host(who, value)
    except ValueError:
        return _bad_host(who, value)


def _bad_host(who: str, value):
    raise SyncError(f"{who}: its info's 'host' is {str(value)[:40]!r}, not an IP address")
MAX_REGIONS = 1 << 24


def words(who: str, record: dict, key: str, n: int = 1) -> list[int]:
    """`record[key]` of `who`'s info: `n` integers in [0, 2**63) (an address, a size), or a SyncError naming them."""
    value = record.get(key)
    value = [value] if n == 1 and not isinstance(value, list) else value
    if not _words(value, n):
        raise SyncError(f"{who}: its info's {key!r} is {str(record.get(key))[:40]}, expected {n} integer(s) in [0, 2**63)")
    return value


def _words(value, n: int) -> bool:
    return (isinstance(value, list) and len(value) == n
            and all(isinstance(v, int) and not isinstance(v, bool) and 0 <= v < ADDRESS_LIMIT for v in value))


def _areas(who: str, record: dict, key: str, names: tuple[str, ...]) -> dict[str, Area] | None:
    """`record[key]`, an object of [address, bytes] areas named `names`, absent (None) or a SyncError naming it."""
    value = record.get(key)
    if value is None:
        return None
    if not isinstance(value, dict) or set(value) != set(names):
        raise SyncError(f"{who}: its info's {key!r} is not an object of {', '.join(names)}")
    return {name: check_area(*words(who, value, name, 2), f"{key}.{name}", who) for name in names}


@dataclass(frozen=True)
class DeltaRecord:
    """What trainer rank's delta of a version is computed from: `base` (the version it published before, None when it
    has no delta for this one), the delta's bytes, and the SHA-256 of its page index (its registered sizes)."""

    base: int | None
    nbytes: int
    index_sha256: str
    density: float | None = None  # changed units over page units, as the trainer measured them (absent: older senders)


def delta_record(record: DeltaRecord) -> dict:
    return {"base": record.base, "bytes": record.nbytes, "index": record.index_sha256,
            **({"density": record.density} if record.density is not None else {})}


def parse_delta_record(value: dict, rank: int, version: int) -> DeltaRecord:
    """The DeltaRecord a store value spells; SyncError naming the field otherwise."""
    base, nbytes, digest = value.get("base"), value.get("bytes"), value.get("index")
    if not (base is None or (isinstance(base, int) and not isinstance(base, bool) and 0 < base < version)):
        raise SyncError(f"trainer rank {rank}: its delta record of version {version} names base {str(base)[:24]}")
    if not isinstance(nbytes, int) or isinstance(nbytes, bool) or not 0 <= nbytes < 1 << 62:
        raise SyncError(f"trainer rank {rank}: its delta record of version {version} has bytes {str(nbytes)[:24]}")
    if not isinstance(digest, str) or not re.fullmatch(r"[0-9a-f]{64}", digest):
        raise SyncError(f"trainer rank {rank}: its delta record of version {version} has no SHA-256 index digest")
    density = value.get("density")
    if not (density is None or (isinstance(density, (int, float)) and not isinstance(density, bool) and 0 <= density <= 1)):
        raise SyncError(f"trainer rank {rank}: its delta record of version {version} has density {str(density)[:24]}")
    return DeltaRecord(base, nbytes, digest, None if density is None else float(density))


def published_key(rank: int) -> str:
    """The last version trainer rank `rank` published (value: `published_record`), rewritten at every publish: a
    restarted trainer (a new incarnation) must publish a later one (`check_resumed`)."""
    return f"trainer/{rank}/published"


def published_record(version: int, incarnation: str) -> dict:
    return {"version": version, "incarnation": incarnation}


def check_resumed(rendezvous: Store, rank: int, version: int, incarnation: str, job: str) -> None:
    """SyncError when an earlier incarnation of trainer `rank` published `version` or a later one: a trainer resumed
    from a checkpoint with its version counter behind what readers may hold (nothing is published)."""
    key = published_key(rank)
    if not rendezvous.exists(key):
        return
    record = rendezvous.get_json(key)
    last, by = record.get("version"), record.get("incarnation")
    if not (isinstance(last, int) and not isinstance(last, bool) and last > 0 and isinstance(by, str)
            and INCARNATION.fullmatch(by)):
        raise SyncError(f"trainer rank {rank}: its published record holds no valid version and incarnation")
    if by != incarnation and version <= last:
        raise SyncError(f"trainer rank {rank}: version {version} is not after version {last}, which an earlier process "
                        f"of this rank published in job {job!r}: a restarted trainer resumes its version counter from "
                        f"its checkpoint and publishes a later version (a new run takes a new job id); nothing published")


def store_key() -> str:
    """The store's identity (value: a random hex id) written by the process serving it: a client that reconnects and
    finds another id (or none) knows the store was restarted and lost the job's records."""
    return "store/id"


def joined_key(rank: int) -> str:
    """Inference `rank` joined the job (value: `joined_record`); trainers and pullers wait for the ranks that joined."""
    return f"inference/{rank}/joined"


def returning_key(rank: int, version: int) -> str:
    """Inference `rank`, after a failed sync (a cut link, a lost trainer), reaches the store again and is about to renew
    its connections and read `version` (value: its incarnation): a trainer that gave up on it holds that version's
    release open for it a while (runtime/sender/sender.py `RETURN_GRACE_S`), rather than move on while it reconnects."""
    return f"inference/{rank}/returning/{version}"


def joined_record(incarnation: str, agent: str, plan: str | None = None) -> dict:
    """`plan`: the fingerprint of the plan the rank runs (absent from older receivers' records)."""
    return {"incarnation": incarnation, "agent": agent, **({"plan": plan} if plan is not None else {})}


class Store(Protocol):
    """What reading a record needs of the rendezvous (transport/rendezvous.py's Rendezvous)."""

    def exists(self, key: str) -> bool: ...

    def get_json(self, key: str): ...


class Notified(Protocol):
    """What reading notifications needs of a process's transport (transport/reader.py's Transport)."""

    def notifications(self) -> dict[str, list[str]]: ...


def joined_incarnation(rendezvous: Store, rank: int) -> str | None:
    """The incarnation inference `rank` joined with, None if it has not joined; SyncError if the record is unreadable
    or holds no valid incarnation."""
    return _incarnation(rendezvous, joined_key(rank), f"inference rank {rank}: its joined record")


def joined_plan(rendezvous: Store, rank: int) -> tuple[str, str | None] | None:
    """(incarnation, plan fingerprint) inference `rank` joined with, the fingerprint None for a record without one; None
    if it has not joined. A trainer waits only for ranks that joined with its own plan: after a resize to another
    plan (docs/operations.md), a rank of the old size still running never holds a release of the new one."""
    key = joined_key(rank)
    if not rendezvous.exists(key):
        return None
    record = rendezvous.get_json(key)
    if not isinstance(record, dict):
        raise SyncError(f"inference rank {rank}: its joined record is not an object")
    incarnation, plan = record.get("incarnation"), record.get("plan")
    if not isinstance(incarnation, str) or not INCARNATION.fullmatch(incarnation):
        raise SyncError(f"inference rank {rank}: its joined record has no valid incarnation")
    if plan is not None and not (isinstance(plan, str) and re.fullmatch(r"[0-9a-f]{64}", plan)):
        raise SyncError(f"inference rank {rank}: its joined record's plan is {str(plan)[:40]}, not a plan fingerprint")
    return incarnation, plan


def left_key(rank: int) -> str:
    """Inference `rank`'s process left the job (value: `left_record`, its incarnation), written by `Receiver.close()`:
    trainers stop waiting for that incarnation at their next release; a later join (another incarnation) counts again."""
    return f"inference/{rank}/left"


def left_record(incarnation: str) -> dict:
    return {"incarnation": incarnation}


def left_incarnation(rendezvous: Store, rank: int) -> str | None:
    """The incarnation of inference `rank` that left, None if none did; SyncError as joined_incarnation."""
    return _incarnation(rendezvous, left_key(rank), f"inference rank {rank}: its left record")


def _incarnation(rendezvous: Store, key: str, what: str) -> str | None:
    if not rendezvous.exists(key):
        return None
    incarnation = rendezvous.get_json(key).get("incarnation")
    if not isinstance(incarnation, str) or not INCARNATION.fullmatch(incarnation):
        raise SyncError(f"{what} has no valid incarnation")
    return incarnation


class Kind(enum.Enum):
    """What a notification says about a version."""

    BEGIN = "begin"  # receiver -> trainer: it starts reading
    ACK = "ack"  # receiver -> trainer: it read every byte it needs
    FAIL = "fail"  # receiver -> trainer: its sync failed; it reads no more
    RING = "ring"  # receiver -> trainer: it read ring chunk `chunk`
    HOP = "hop"  # peer -> puller: it is done with the puller's first hop (read, or failed)


@dataclass(frozen=True)
class Message:
    """One notification: `kind` of `version` (and for RING, the ring chunk)."""

    kind: Kind
    version: int
    chunk: int = -1

    @property
    def text(self) -> str:
        return f"ring:{self.version}:{self.chunk}" if self.kind is Kind.RING else f"{self.kind.value}:{self.version}"


# Versions are below 2**62 (runtime/checks.py) and ring chunks fewer: 19 digits bound both.
_MESSAGE = re.compile(r"(begin|ack|fail|hop):(\d{1,19})|ring:(\d{1,19}):(\d{1,19})")


def parse_message(text: str) -> Message | None:
    """The message `text` spells in full, None for anything else."""
    match = _MESSAGE.fullmatch(text)
    if match is None:
        return None
    if match[1] is None:
        return Message(Kind.RING, int(match[3]), int(match[4]))
    return Message(Kind(match[1]), int(match[2]))


def begin(version: int) -> str:
    return Message(Kind.BEGIN, version).text


def ack(version: int) -> str:
    return Message(Kind.ACK, version).text


def fail(version: int) -> str:
    return Message(Kind.FAIL, version).text


def ring(version: int, chunk: int) -> str:
    return Message(Kind.RING, version, chunk).text


def hop(version: int) -> str:
    return Message(Kind.HOP, version).text


def received(agent: Notified, senders: dict[str, int], kinds: frozenset[Kind], who: str):
    """(rank, Message) for each new notification of one of `kinds` from an agent in `senders` ({agent name: rank});
    notifications from other agents, or of other kinds or malformed, are logged and dropped (peers are not trusted)."""
    for name, texts in agent.notifications().items():
        rank = senders.get(name)
        if rank is None:
            log.warning("%s: ignoring notifications from unknown agent %r", who, name)
            continue
        for text in texts:
            message = parse_message(text)
            if message is None or message.kind not in kinds:
                log.warning("%s: ignoring malformed notification from %s", who, name)
                continue
            yield rank, message
