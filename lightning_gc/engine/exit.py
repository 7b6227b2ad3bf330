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

import torch.distributed as dist

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
