"""Which target-side progress a NIXL agent gets (runtime/transport/progress.py), and the background poll's life."""

from __future__ import annotations

import pytest

from weightplan.runtime.errors import WeightplanError
from weightplan.runtime.transport.progress import BackgroundPoll, resolve


@pytest.mark.parametrize("ucx_tls, expected", [
    ("", "poll"),  # unset: UCX may choose TCP between nodes
    ("tcp,self", "poll"),
    ("tcp", "poll"),
    ("sm,cma,self", "poll"),  # measured here: READs over cma waited for the target too
    ("^tcp", "poll"),  # an exclusion list leaves UCX free to choose
    ("all", "poll"),
    ("rc,self", "none"),
    ("rc_mlx5,dc_mlx5,cuda_ipc,cuda_copy,self", "none"),
])
def test_auto_polls_unless_every_transport_is_one_sided(ucx_tls, expected):
    assert resolve("auto", ucx_tls) == expected


@pytest.mark.parametrize("mode", ["poll", "thread", "none"])
def test_an_explicit_mode_wins(mode):
    assert resolve(mode, "rc") == resolve(mode, "tcp") == mode


def test_a_bad_mode_is_one_line():
    with pytest.raises(WeightplanError, match="progress must be one of auto, poll, thread, none, not 'fast'"):
        resolve("fast")


class _CountingAgent:
    """Stands in for a nixl_agent: counts progress calls and hands out one notification."""

    def __init__(self):
        self.calls = 0

    def get_new_notifs(self):
        self.calls += 1
        return {b"peer": [b"ack:1"]} if self.calls == 1 else {}


def test_the_background_poll_progresses_until_stopped_and_keeps_what_it_received():
    import time

    agent = _CountingAgent()
    poll = BackgroundPoll(agent, "test", interval=0.001)
    time.sleep(0.1)
    collected = poll.stop()
    calls = agent.calls
    time.sleep(0.02)
    assert calls >= 10 and agent.calls == calls  # it polled, and stopped when told
    assert collected == [{b"peer": [b"ack:1"]}]
