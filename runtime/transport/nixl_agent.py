"""A thin wrapper over one NIXL agent (UCX backend, host and CUDA memory): register, prepare, read, notify."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import numpy as np
import torch

from ..errors import SyncError, WeightplanError
from .links import links_up
from .memory import HOST, EMPTY, MemoryMap, RowGroups, Span, group_rows, group_spans
from .progress import BackgroundPoll, resolve

log = logging.getLogger("weightplan.runtime")
# UCX handles one huge request list much more slowly than several smaller ones (measured by
# benchmarks/bench_runtime.py's host-overhead rows), so descriptors go out in chunks of this many.
DESCRIPTORS_PER_READ = 4096


def _nixl():
    """NIXL's agent classes, from the build matching torch's CUDA major (nixl-cu12 or nixl-cu13, the same API; the
    `nixl` package installs both), else whichever imports (a CPU torch: cu12 first). Imported lazily: the plan reader
    and the host executor work without NIXL installed."""
    import importlib

    major = (torch.version.cuda or "").split(".")[0]
    order = dict.fromkeys([f"nixl_cu{major}" if major else "nixl_cu12", "nixl_cu12", "nixl_cu13"])
    for i, name in enumerate(order):
        try:
            api = importlib.import_module(f"{name}._api")
        except ImportError:
            if i == len(order) - 1:
                raise WeightplanError("NIXL is not installed: install weightplan with its dependencies (the `nixl` "
                                      "package)") from None
            continue
        return api.nixl_agent, api.nixl_agent_config


class PeerLost(SyncError):
    """A READ failed at once: NIXL holds the connection to that peer broken (its process died, or a link cut broke it,
    possibly while nothing was read). Connecting again from its published metadata may heal it."""


class Unreachable(SyncError):
    """A peer's agent metadata could not be loaded: UCX could not connect to it (its process exited, its node is
    unreachable, or this agent's worker cannot reach it). A new agent may reach it where this one cannot."""


class Backoff:
    """The pause between polls of something not ready yet: 10 us, doubling up to 1 ms."""

    def __init__(self):
        self.pause = 1e-5

    def sleep(self) -> None:
        time.sleep(self.pause)
        self.pause = min(2 * self.pause, 1e-3)


@dataclass(frozen=True)
class Prepared:
    """One prepared descriptor list as callers see it: a NIXL list per placement its rows lie in (`rows` says where),
    and its (address, bytes) rows (`table`), which a reader other than NIXL (runtime/transport/local_peer.py) copies into."""

    lists: tuple
    rows: RowGroups
    table: np.ndarray


@dataclass(frozen=True)
class Read:
    """One READ as callers see it: a NIXL transfer per (local, remote) placement pair its descriptors use."""

    handles: tuple


class NixlAgent:
    """One NIXL agent of this process. Every transfer is a one-sided READ initiated here."""

    path = "nixl"  # its name in SyncReport.paths

    def __init__(self, name: str, progress: bool | str = False):
        """`progress` (runtime/transport/progress.py): "thread" (or True) is NIXL's progress thread, which spins a
        whole core even when idle (measured: 2.9 s of CPU per 3 s); "poll" a light thread the owner runs with
        `background(True)` while it does not poll itself; "none" (or False) progress only when this process
        polls; "auto" whichever of "poll" and "none" the UCX transports need."""
        nixl_agent, nixl_agent_config = _nixl()
        self.name = name
        self.progress = resolve({True: "thread", False: "none"}.get(progress, progress))
        self.links = links_up()  # what its UCX worker lists, once: before it is made, so a change after is never missed
        self._agent = nixl_agent(name, nixl_agent_config(backends=["UCX"], enable_prog_thread=self.progress == "thread"))
        self._registered = []
        self._poll: BackgroundPoll | None = None
        self._collected: list[dict] = []  # notifications the background poll received, not yet handed out
        self.memory = EMPTY  # what this agent registered, by placement (published as its info's 'memory')
        self.stuck = False  # a READ timed out or failed: it may still be queued on a broken connection

    def register(self, tensors: list[torch.Tensor]) -> None:
        """Register tensors once, host (DRAM) and CUDA (VRAM, per device) alike: one NIXL registration per placement,
        since a NIXL list holds one memory type. Descriptors must fall inside registered memory."""
        spans = [Span.of(t) for t in tensors if t.numel()]
        for placement, group in group_spans(spans).items():
            table = np.array([[s.address, s.nbytes, placement.device] for s in group], dtype=np.uint64)
            self._registered.append(self._agent.register_memory(table, placement.kind))
        self.memory = MemoryMap.of(self.memory.spans() + spans)

    def metadata(self) -> bytes:
        return self._agent.get_agent_metadata()

    @property
    def links_changed(self) -> bool:
        """This host's usable network links differ from those its UCX worker listed when it was made (links.py): a
        link that was down then (a node cut off) is one this agent can never use; only a new agent can."""
        return links_up() != self.links

    def close(self) -> None:
        """Deregister every registered tensor and release the NIXL agent; idempotent (an engine shutdown calls it)."""
        if self._agent is None:
            return
        self.background(False)
        agent, self._agent = self._agent, None
        for registered in self._registered:
            try:
                agent.deregister_memory(registered)
            except Exception as exc:  # NIXL raises its own status types; the memory is released with the agent anyway
                log.debug("deregistering memory of %s: %s", self.name, exc)
        self._registered = []

    def background(self, on: bool) -> None:
        """With progress "poll", start (on) or stop the background poll; the owner must not use the agent while it
        runs. Owners turn it on while peers may read and they do not poll (a trainer between publish and release)."""
        if on and self.progress == "poll" and self._poll is None and self._agent is not None:
            self._poll = BackgroundPoll(self._agent, self.name)
        elif not on and self._poll is not None:
            self._collected += self._poll.stop()
            self._poll = None

    @property
    def closed(self) -> bool:
        return self._agent is None

    def add_peer(self, metadata: bytes, expected_name: str) -> None:
        """Load a remote agent's metadata, refusing it unless it names the agent the plan expects."""
        try:
            name = self._agent.add_remote_agent(metadata)
        except Exception as exc:
            self.stuck = True
            # Seen when UCX cannot connect to it (Connection refused): that process exited, or its node is unreachable.
            raise Unreachable(f"cannot load agent metadata published for {expected_name!r}: {type(exc).__name__} (UCX "
                              "cannot connect to it: has that process exited, or is its node unreachable?)") from None
        name = name.decode() if isinstance(name, bytes) else name
        if name != expected_name:
            self._agent.remove_remote_agent(name)
            raise SyncError(f"rejected agent metadata naming {name!r}: this rank expects {expected_name!r} there")

    def remove_peer(self, name: str) -> None:
        try:
            self._agent.remove_remote_agent(name)
        except Exception as exc:  # NIXL raises its own status types; the peer is gone either way
            log.debug("removing agent %s: %s", name, exc)

    def prepare(self, peer: str | None, rows: np.ndarray, memory: MemoryMap | None = None) -> Prepared:
        """Prepare a descriptor list of (address, bytes) rows, local (peer None) or on a peer, once.

        Each row's memory type and device come from where it lies: this agent's registrations for local rows, the
        peer's published `memory` for remote ones (SyncError for a row outside it)."""
        rows = np.asarray(rows).reshape(-1, 2)
        try:
            groups = group_rows(self.memory if peer is None else memory or EMPTY, rows) if len(rows) else None
        except ValueError as exc:
            if peer is None:
                raise WeightplanError(f"{self.name}: a local descriptor {exc}") from None
            raise SyncError(f"{peer}: a descriptor {exc} of that process (its info's 'memory')") from None
        if groups is None:  # an empty list: the memory type does not matter
            return Prepared((self._agent.prep_xfer_dlist(peer or "NIXL_INIT_AGENT", np.zeros((0, 3), dtype=np.uint64),
                                                         HOST.kind),), group_rows(EMPTY, rows), rows)
        lists = []
        for placement, members in zip(groups.placements, groups.members):
            table = np.zeros((len(members), 3), dtype=np.uint64)
            table[:, :2] = rows[members]
            table[:, 2] = placement.device
            lists.append(self._agent.prep_xfer_dlist(peer or "NIXL_INIT_AGENT", table, placement.kind))
        return Prepared(tuple(lists), groups, rows)

    def make_read(self, local: Prepared, remote: Prepared, indices: np.ndarray, message: bytes = b"") -> Read:
        """A READ of the given descriptor indices of two prepared lists (row i of one into row i of the other): one
        NIXL transfer per pair of placements they use, usually one. Post it with `post` each sync."""
        idx = np.asarray(indices, dtype=np.int64).reshape(-1)
        pair = local.rows.group[idx] * len(remote.lists) + remote.rows.group[idx] if len(idx) else np.zeros(0, np.int64)
        handles = []
        for key in np.unique(pair).tolist():
            chosen = idx[pair == key]
            lg, rg = divmod(key, len(remote.lists))
            handles.append(self._agent.make_prepped_xfer(
                "READ", local.lists[lg], np.ascontiguousarray(local.rows.index[chosen], dtype=np.int32),
                remote.lists[rg], np.ascontiguousarray(remote.rows.index[chosen], dtype=np.int32), message))
        return Read(tuple(handles))

    def make_reads(self, local, remote, rows: np.ndarray) -> list:
        """READs of descriptor rows `rows` of two prepared lists, DESCRIPTORS_PER_READ rows per request."""
        return [self.make_read(local, remote, rows[i : i + DESCRIPTORS_PER_READ])
                for i in range(0, len(rows), DESCRIPTORS_PER_READ)]

    def path_bytes(self, memory: MemoryMap, rows: np.ndarray) -> dict[str, int]:
        """{path: bytes} READing (address, bytes) `rows` of a peer's `memory` moves: all of them over NIXL."""
        return {self.path: int(np.asarray(rows).reshape(-1, 2)[:, 1].sum())}

    def read_now(self, handles: list[tuple[object, str]], deadline: float, what: str) -> None:
        """Post every prepared (READ, peer) and wait for all of them."""
        for handle, peer in handles:
            self.post(handle, peer)
        self.wait(handles, deadline, what)

    def post(self, handle: Read, peer: str) -> None:
        for part in handle.handles:
            try:
                state = self._agent.transfer(part)
            except Exception as exc:  # NIXL raises per-status exception types (e.g. nixlRemoteDisconnectError)
                self.stuck = True
                raise PeerLost(f"posting a READ from {peer} failed: {type(exc).__name__} (did that process die?)") from None
            if state == "ERR":
                self.stuck = True
                raise PeerLost(f"NIXL refused to post a READ from {peer} (did that process die?)")

    def _state(self, handle: Read) -> str:
        """ERR if any part failed, DONE once every part is done, else PROC."""
        states = [self._agent.check_xfer_state(part) for part in handle.handles]
        return "ERR" if "ERR" in states else "DONE" if all(s == "DONE" for s in states) else "PROC"

    def wait(self, handles: list[tuple[object, str]], deadline: float, what: str) -> dict[str, float]:
        """Wait until every posted (transfer, peer) is done; an error state or the deadline raises SyncError.

        Returns, per peer, the time (time.monotonic) its last transfer was seen done.
        """
        pending = list(handles)
        done_at = {peer: time.monotonic() for _, peer in handles}
        backoff = Backoff()
        while pending:
            still = []
            now = time.monotonic()
            for handle, peer in pending:
                try:
                    state = self._state(handle)
                except Exception as exc:  # as in post(): a status turned into an exception
                    self.stuck = True
                    raise PeerLost(f"{what}: a READ from {peer} failed: {type(exc).__name__} (did that process die?)") from None
                if state == "ERR":
                    self.stuck = True
                    raise PeerLost(f"{what}: a READ from {peer} failed (its process died or deregistered its memory)")
                if state != "DONE":
                    still.append((handle, peer))
                else:
                    done_at[peer] = max(done_at[peer], now)
            pending = still
            if pending:
                if time.monotonic() > deadline:
                    self.stuck = True
                    peers = sorted({peer for _, peer in pending})
                    raise SyncError(f"{what}: timed out waiting for READs from {', '.join(peers)}")
                backoff.sleep()
        return done_at

    def release(self, handle: Read) -> None:
        for part in handle.handles:
            try:
                self._agent.release_xfer_handle(part)
            except Exception as exc:  # a handle to a dead peer may refuse release; nothing else to do
                log.debug("releasing a transfer handle: %s", exc)

    def release_list(self, prepared: Prepared) -> None:
        for part in prepared.lists:
            try:
                self._agent.release_dlist_handle(part)
            except Exception as exc:  # as for transfer handles: best effort once the peer is gone
                log.debug("releasing a prepared list: %s", exc)

    def notify(self, peer: str, message: str) -> None:
        try:
            self._agent.send_notif(peer, message.encode())
        except Exception as exc:  # a dead peer cannot be told; callers treat notifications as best effort
            log.debug("notifying %s: %s", peer, exc)

    def flush(self, seconds: float) -> None:
        """Progress this agent for `seconds` (notifications just sent go out), keeping what it receives."""
        until = time.monotonic() + seconds
        while time.monotonic() < until:
            self._collected.append(self._agent.get_new_notifs())
            time.sleep(0.001)

    def notifications(self) -> dict[str, list[str]]:
        """New notifications by sender agent name."""
        out = {}
        batches, self._collected = [*self._collected, self._agent.get_new_notifs()], []
        for batch in batches:
            for name, messages in batch.items():
                name = name.decode() if isinstance(name, bytes) else name
                out.setdefault(name, []).extend(m.decode(errors="replace") for m in messages)
        return out
