"""Release the default process group before the interpreter finalises (gloo and every backend but NCCL).

Why: a process that ends without ``torch.distributed.destroy_process_group()`` tears the gloo process
group down during interpreter finalisation. Its C++ worker threads can then still hold work objects
whose tensors have Python references, and destroying them after the interpreter is gone aborts the
process (``terminate called without an active exception``, exit status -6) *after* training has
finished and its results were written. It is rare (seen once in a CI run of the test suite, after a
two-process fit had written its results) but it turns a good run into a failed exit status for a
launcher or a CI job.

Lightning registers an ``atexit`` destroy for NCCL only; :func:`destroy_default_group_at_exit`
registers the same for the other backends, once per process. ``atexit`` handlers run while the
interpreter is still whole, and destroying a gloo group is local (no collective), so a peer that is
still running cannot make it hang. A script that destroys the group itself first is unaffected: the
handler does nothing when no group is left.
"""

from __future__ import annotations

import atexit
import os
import sys
from typing import Any

import torch.distributed as dist
from lightning.pytorch.strategies.launchers import _MultiProcessingLauncher
from lightning.pytorch.strategies.launchers.multiprocessing import _disable_module_memory_sharing

_registered = [False]


def _destroy_default_group() -> None:
    if dist.is_available() and dist.is_initialized():
        try:
            dist.destroy_process_group()
        except (RuntimeError, ValueError):  # already being torn down elsewhere: nothing left to release
            pass


def destroy_default_group_at_exit() -> bool:
    """Register the exit handler if a non-NCCL default group exists; True if it is (now) registered."""
    if _registered[0]:
        return True
    if not (dist.is_available() and dist.is_initialized()):
        return False
    if "nccl" in str(dist.get_backend()).lower():
        return False  # Lightning's own handler destroys NCCL groups
    atexit.register(_destroy_default_group)
    _registered[0] = True
    return True


class ExitCleanMultiProcessingLauncher(_MultiProcessingLauncher):
    """Lightning's launcher for ``start_method="spawn"``/``"fork"``/``"forkserver"``, whose worker processes
    leave with ``os._exit(0)`` once their work is done and their results are on the return queue.

    A ``forkserver`` worker is forked from a server started earlier, so it would have the server's
    environment and working directory, not the launching process's (``PL_GLOBAL_SEED``, ``MASTER_PORT``,
    the user's variables), and the module it receives would share its tensors' memory with the other
    ranks' copies (Lightning unshares only under ``spawn``): every rank would then step the same
    parameters. Here it starts as a spawned worker would: the launching process's environment and working
    directory (taken when the worker's arguments are pickled) and a module of its own. Why offer it at
    all: a server that preloaded torch and lightning starts each worker without re-importing them.

    Why: a spawned worker that finishes its fit and then runs the interpreter's normal shutdown
    tears torch's gloo objects down there, and that aborted a worker once in CI (``terminate called
    without an active exception``, SIGABRT) after its fit had ended, which failed the launcher's
    join and so the whole ``fit``. Everything a worker produces is written before this point: the
    trainer's teardown has closed the loggers and checkpoints, rank 0 has put its results on the
    return queue (a ``SimpleQueue``: the write is done when ``put`` returns), and standard output is
    flushed here. What is skipped is what the interpreter would run at exit in a spawned worker
    (``atexit`` handlers, finalisers); a forked worker never runs them anyway. A worker that raised
    leaves the usual way, so the launcher reports its exception.
    """

    def __getstate__(self) -> dict[str, Any]:
        # pickled once per worker, in the launching process, after Lightning set MASTER_PORT there
        return {**self.__dict__, "_launch_environ": dict(os.environ), "_launch_cwd": os.getcwd()}

    def _wrapping_function(self, process_idx: int, trainer: Any, function: Any, args: Any, kwargs: Any,
                           *rest: Any) -> None:
        if self._start_method == "forkserver":
            os.environ.clear()
            os.environ.update(self.__dict__.get("_launch_environ", {}))
            os.chdir(self.__dict__.get("_launch_cwd", os.getcwd()))
            args, kwargs = _disable_module_memory_sharing((args, kwargs))
        super()._wrapping_function(process_idx, trainer, function, args, kwargs, *rest)
        _destroy_default_group()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
