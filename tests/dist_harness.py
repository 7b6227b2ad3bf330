"""Run a function on several gloo ranks from inside pytest.

``run_distributed(fn, world_size, *args)`` starts ``world_size`` processes (forks of a preloading
forkserver by default, see ``START_METHOD``), initialises a
gloo process group on a free loopback port, calls ``fn(rank, world_size, *args)`` on every rank and
returns the list of per-rank return values (pickled back through a queue). Any exception on any
rank is re-raised in the parent with that rank's traceback, and a hung group is killed after
``timeout`` seconds, so a deadlock fails the test instead of hanging the suite.

``fn`` must be defined at module level (the ranks import it by name).
"""

from __future__ import annotations

import io
import os
import queue as queue_mod
import socket
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.multiprocessing as mp

#: How ranks start. ``forkserver`` (the default): one server process imports torch, lightning and
#: lightning_gc once for the whole session, and each rank is a fork of it, so a rank does not pay
#: the ~5 s of imports that a ``spawn``ed one does (most of a small multi-process test's time on
#: 2 cores). Each rank still starts from a clean interpreter state (the server runs no test code),
#: and gets the parent's environment of the moment (``_entry`` applies it). ``GC_TEST_START_METHOD=
#: spawn`` restores fresh interpreters.
START_METHOD = os.environ.get("GC_TEST_START_METHOD", "forkserver")
PRELOAD = ["torch", "torch.distributed", "lightning", "lightning_gc"]


def context() -> Any:
    """The multiprocessing context ranks start from (see :data:`START_METHOD`)."""
    ctx = mp.get_context(START_METHOD)
    if START_METHOD == "forkserver":
        ctx.set_forkserver_preload(PRELOAD)  # takes effect when the server starts (once per session)
    return ctx


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank: int, world_size: int, port: int, fn: Callable, args: tuple, queue: Any,
           environ: dict[str, str] | None = None) -> None:
    import torch
    import torch.distributed as dist

    if environ is not None:  # a forkserver child has the server's environment and cwd, not the test's
        cwd = environ.pop("_GC_TEST_CWD", os.getcwd())
        os.environ.clear()
        os.environ.update(environ)
        os.chdir(cwd)
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world_size)
        result = fn(rank, world_size, *args)
        # serialise to bytes: tensors sent as-is would travel through shared-memory handles that
        # die with this process before the parent reads them
        buf = io.BytesIO()
        torch.save(result, buf)
        queue.put((rank, True, buf.getvalue()))
    except BaseException:  # noqa: BLE001 - forwarded to the parent verbatim
        queue.put((rank, False, traceback.format_exc()))
    finally:
        # Deliver the report (the queue's feeder thread writes it), then leave without tearing torch
        # down: a gloo process group destroyed at exit, or from one of its own worker threads that held
        # the last reference to it, can abort a rank ("terminate called ... Resource deadlock
        # avoided", exit -6) after its result was queued but before it was written, which the parent
        # saw as a rank that "died without reporting" (CI, torch's PowerSGD hook test). That teardown
        # is torch's, not what these tests check; lightning_gc's own is tested in test_teardown.py.
        queue.close()
        queue.join_thread()
        os._exit(0)


def run_distributed(fn: Callable, world_size: int, *args: Any, timeout: float = 180.0) -> list[Any]:
    ctx = context()
    queue = ctx.Queue()
    port = free_port()
    environ = {**os.environ, "_GC_TEST_CWD": os.getcwd()}
    procs = [ctx.Process(target=_entry, args=(r, world_size, port, fn, args, queue, environ))
             for r in range(world_size)]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    errors: list[str] = []
    deadline = time.monotonic() + timeout
    try:
        while len(results) < world_size and not errors:
            try:
                rank, ok, payload = queue.get(timeout=0.5)
            except queue_mod.Empty:
                dead = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0) and r not in results]
                if dead:
                    errors.append(f"ranks {dead} died without reporting (exit codes "
                                  f"{[procs[r].exitcode for r in dead]})")
                elif time.monotonic() > deadline:
                    errors.append(f"timed out after {timeout}s waiting for ranks; "
                                  f"ranks that answered: {sorted(results)}")
                continue
            if ok:
                results[rank] = torch.load(io.BytesIO(payload), weights_only=False)
            else:
                errors.append(f"rank {rank} failed:\n{payload}")
    finally:
        for p in procs:
            p.join(timeout=5 if not errors else 0.5)
            if p.is_alive():
                p.kill()
                p.join()
    if errors:
        raise AssertionError("\n".join(errors))
    return [results[r] for r in range(world_size)]


def gather_all(t: torch.Tensor, world_size: int) -> list[torch.Tensor]:
    """Every rank's copy of ``t`` (``all_gather``), for oracles computed from all ranks' inputs."""
    import torch.distributed as dist

    out = [torch.empty_like(t) for _ in range(world_size)]
    dist.all_gather(out, t.contiguous())
    return out
