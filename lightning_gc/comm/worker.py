"""The ordered worker: one thread that runs the engine's exchanges in submission order.

Why a thread of our own, and why only one:

* A DDP comm hook runs on the autograd thread; if it waited for the network, backward would stop
  until the exchange finished. The hook therefore only *submits* work and returns a Future.
* Multi-stage exchanges (P2P ring/tree, AR-Topk's broadcast-then-reduce, allgather-then-decode)
  need several blocking calls in sequence. gloo has no Future for ``isend``/``irecv`` or
  ``reduce_scatter``, and a Future callback must never issue a collective (same group: deadlock
  with no timeout; another group: the order differs across ranks). So the sequence runs on a
  thread of its own.
* Two threads issuing on one process group silently pair results with the wrong collective. All
  of the engine's communication goes through this one thread, on a process group created for it,
  and every rank submits the same jobs in the same order, so every rank issues the same
  collectives in the same order.

On CUDA the worker runs its jobs on a side stream of its own; the job itself waits for the event
the hook recorded, so compression and communication overlap the compute on the default stream
without any device-wide synchronisation.

A job that raises does not stop the thread; it is the job's business to fail the Futures it owns
(the engine's jobs do). :meth:`drain` waits until every submitted job has run.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable

import torch

_STOP = object()


class OrderedWorker:
    """Run submitted callables one at a time, in submission order, on a dedicated thread."""

    def __init__(self, name: str = "lightning_gc-exchange", device: torch.device | None = None) -> None:
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._cond = threading.Condition()
        self._outstanding = 0
        self._closed = False
        self._device = device
        self._stream = (
            torch.cuda.Stream(device=device) if device is not None and device.type == "cuda" else None
        )
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    def submit(self, job: Callable[[], None]) -> None:
        with self._cond:
            if self._closed:
                raise RuntimeError("lightning_gc: the exchange worker was closed; the engine cannot run more steps.")
            self._outstanding += 1
        self._queue.put(job)

    def drain(self, timeout: float | None = None) -> bool:
        """Wait until every submitted job has run; False if ``timeout`` expired first."""
        if threading.current_thread() is self._thread:
            return True
        with self._cond:
            return self._cond.wait_for(lambda: self._outstanding == 0, timeout=timeout)

    def close(self, timeout: float | None = 60.0) -> bool:
        """Run what is queued, stop the thread and join it. Returns False if it did not stop in time."""
        with self._cond:
            if self._closed:
                return not self._thread.is_alive()
            self._closed = True
        self._queue.put(_STOP)
        self._thread.join(timeout)
        return not self._thread.is_alive()

    def _loop(self) -> None:
        if self._device is not None and self._device.type == "cuda":
            torch.cuda.set_device(self._device)
        while True:
            job = self._queue.get()
            if job is _STOP:
                return
            try:
                if self._stream is not None:
                    with torch.cuda.stream(self._stream):
                        job()
                else:
                    job()
            except BaseException:  # noqa: BLE001 - jobs fail their own Futures; keep serving
                pass
            finally:
                with self._cond:
                    self._outstanding -= 1
                    self._cond.notify_all()


class InlineRunner:
    """The synchronous schedule: jobs run at once on the caller's thread (``overlap=False``)."""

    def submit(self, job: Callable[[], None]) -> None:
        job()

    def drain(self, timeout: float | None = None) -> bool:
        return True

    def close(self, timeout: float | None = 60.0) -> bool:
        return True
