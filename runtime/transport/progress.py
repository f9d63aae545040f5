"""Target-side progress of a NIXL agent: which mode a transport needs, and the light background poll."""

from __future__ import annotations

import logging
import os
import threading

from ..errors import WeightplanError

log = logging.getLogger("weightplan.runtime")

MODES = ("auto", "poll", "thread", "none")
# How often the background poll progresses an agent whose owner is not polling (between publish and release).
# Measured by benchmarks/progress_cost.py: about 3 % of a core at this interval (4.8 % at 1 ms), against a spinning
# core for NIXL's own progress thread.
POLL_INTERVAL = 0.002
# UCX transports whose GETs the NIC or the GPU driver serves without the target's CPU (RDMA RC/DC, GPU IPC and copy).
# Any other transport (tcp, and on the hosts measured here even cma) needs the target to progress.
_ONE_SIDED = frozenset({"rc", "rc_v", "rc_x", "rc_mlx5", "dc", "dc_x", "dc_mlx5", "cuda_ipc", "cuda_copy", "gdr_copy",
                        "rocm_ipc", "rocm_copy", "self"})


def check_mode(mode: str) -> str:
    if mode not in MODES:
        raise WeightplanError(f"progress must be one of {', '.join(MODES)}, not {mode!r}")
    return mode


def resolve(mode: str, ucx_tls: str | None = None) -> str:
    """The progress a target agent gets: `mode`, or for "auto" what the transports UCX may use need.

    "auto" is "none" only when UCX_TLS restricts UCX to one-sided transports (RDMA RC/DC, GPU IPC): their READs need
    nothing from the target. Otherwise (UCX_TLS unset, so UCX may choose TCP between nodes; tcp; shared memory; an
    exclusion list) it is "poll": over TCP a READ is a request the target's agent must answer, and here even READs
    over cma waited for the target (docs/runtime.md, "Target-side progress")."""
    check_mode(mode)
    if mode != "auto":
        return mode
    tls = os.environ.get("UCX_TLS") if ucx_tls is None else ucx_tls
    names = [name.strip() for name in (tls or "").split(",") if name.strip()]
    if names and not names[0].startswith("^") and set(names) <= _ONE_SIDED:
        return "none"
    return "poll"


class BackgroundPoll:
    """A daemon thread that progresses one NIXL agent every POLL_INTERVAL until stopped, keeping the notifications
    that progress collected (the owner reads them after `stop`). The owner must not use the agent meanwhile."""

    def __init__(self, nixl_agent, name: str, interval: float = POLL_INTERVAL):
        self._agent, self._interval = nixl_agent, interval
        self._stop = threading.Event()
        self.collected: list[dict] = []
        self._thread = threading.Thread(target=self._run, name=f"weightplan-progress-{name}", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self._interval):
            try:
                new = self._agent.get_new_notifs()
            except Exception as exc:  # a peer's error surfaces to the owner's own calls; the poll just goes on
                log.debug("background progress: %s", exc)
                continue
            if new:
                self.collected.append(new)

    def stop(self) -> list[dict]:
        """Stop and join the thread; returns the notifications it collected (by sender agent name, raw bytes)."""
        self._stop.set()
        self._thread.join()
        return self.collected
