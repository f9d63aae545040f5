"""One version's sync into the staging buffers, run on a background thread while the engine keeps generating."""

from __future__ import annotations

import threading
import time

from weightplan.runtime import Receiver


class BackgroundSync:
    """`receiver.sync(version)` on a thread of its own; `wait()` returns its SyncReport or raises its error.

    Only for staged destinations: the sync writes the staging buffers, never a tensor the engine computes with, so
    the engine's forward passes may run meanwhile."""

    def __init__(self, receiver: Receiver, version: int) -> None:
        self.receiver, self.version = receiver, version
        self.report = None
        self.error: BaseException | None = None
        self.began = time.perf_counter()
        self.ended: float | None = None
        self.thread = threading.Thread(target=self._run, name=f"weightplan-prefetch-v{version}", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        try:
            self.report = self.receiver.sync(self.version)
        except BaseException as exc:  # re-raised by wait() on the worker's thread
            self.error = exc
        finally:
            self.ended = time.perf_counter()

    def wait(self):
        self.thread.join()
        if self.error is not None:
            raise self.error
        return self.report

    @property
    def seconds(self) -> float:
        return (self.ended or time.perf_counter()) - self.began
