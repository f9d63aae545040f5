"""The start()/close() lifecycle of a sync endpoint owning a NIXL agent; `with` starts it and closes it."""

from __future__ import annotations

from .reader import Transport


class AgentOwner:
    """A Sender or Receiver: its constructor only checks and allocates, `start()` creates and registers its
    NIXL agent, `close()` releases it (idempotent)."""

    agent: Transport | None = None

    @property
    def running(self) -> bool:
        """Started and not closed."""
        return self.agent is not None and not self.agent.closed

    def start(self):
        raise NotImplementedError

    def close(self) -> None:
        raise NotImplementedError

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()
