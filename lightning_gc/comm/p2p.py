"""Point-to-point sends and receives for our rings and trees, on any backend and device.

Every ring and tree of lightning_gc (``ring_allreduce``, ``tree_allreduce`` and
``binomial_broadcast`` in :mod:`~lightning_gc.comm.p2p_allreduce`, which carry ``ring``, ``tree``,
``art_ring``, ``art_tree``, ``auto_sparse``, ``marsit`` and ``marsit_cascade``, and GradiVeQ's
ring) sends through the three functions here instead of calling ``torch.distributed`` directly.

Why: gloo has no point-to-point path for CUDA tensors. On an H200 a gloo ``isend`` of a CUDA tensor
closed the connection and killed the rank (docs/gpu.md); ``tests/test_cuda.py`` keeps checking that
fact. gloo's own collectives (``all_reduce``, ``all_gather``, ``broadcast``) accept CUDA tensors
by copying them through host memory. These functions do the same for our sends: where the backend
is not NCCL and a tensor is on a CUDA device, the message travels through a host copy.

* A send copies the tensor to host memory on the current stream. The copy is synchronous, so it
  includes every kernel queued before it on that stream (the worker's side stream, for the
  engine), and the host copy is what gloo sends.
* A receive lands in a host buffer. Once the receive has completed (``wait``), it is copied into
  the CUDA tensor on the current stream, in order with the kernels queued after it.

NCCL sends CUDA tensors directly, and gloo sends CPU tensors directly: nothing is staged there,
and these functions are the plain ``torch.distributed`` calls. The cost of staging is two copies
per message across the host link, the same copies gloo makes for its own collectives on CUDA
tensors. On a single node with GPUs, NCCL (Lightning's default on GPUs) is the fast choice.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

#: backends that send CUDA tensors point to point themselves
_CUDA_P2P_BACKENDS = ("nccl",)


def staged(tensor: torch.Tensor, group: Any) -> bool:
    """Whether ``tensor`` must travel through host memory on ``group``'s backend (CUDA on gloo)."""
    if not tensor.is_cuda:
        return False
    backend = str(dist.get_backend(group)).lower()
    return not any(b in backend for b in _CUDA_P2P_BACKENDS)


def _host_send(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to("cpu", copy=True)


def batch_send_recv(send: torch.Tensor | None, dst: int | None, recv: torch.Tensor | None, src: int | None,
                    group: Any) -> list:
    """Post a send of ``send`` to global rank ``dst`` and a receive into ``recv`` from global rank
    ``src`` together (``batch_isend_irecv``; either may be ``None``). Returns the works: call
    ``wait()`` on every one before reading ``recv`` or changing ``send``."""
    ops: list = []
    receives: list[tuple[torch.Tensor, torch.Tensor]] = []  # (host buffer, device tensor)
    host_send = None
    if send is not None:
        host_send = _host_send(send) if staged(send, group) else None
        ops.append(dist.P2POp(dist.isend, send if host_send is None else host_send, dst, group))
    if recv is not None:
        if staged(recv, group):
            host = torch.empty(recv.shape, dtype=recv.dtype, device="cpu")
            ops.append(dist.P2POp(dist.irecv, host, src, group))
            receives.append((host, recv))
        else:
            ops.append(dist.P2POp(dist.irecv, recv, src, group))
    if not ops:
        return []
    works = list(dist.batch_isend_irecv(ops))  # one per op, or one for the batch (backend-dependent)
    if host_send is None and not receives:
        return works
    return [_Staged(works, receives, host_send)]


class _Staged:
    """A batch staged in host memory: ``wait`` waits for every op of the batch, then copies each
    received host buffer into its device tensor on the current stream. It holds the host copy of the
    send until then."""

    def __init__(self, works: list, copies: list[tuple[torch.Tensor, torch.Tensor]],
                 host_send: torch.Tensor | None) -> None:
        self._works, self._copies, self._host_send = works, copies, host_send

    def wait(self) -> bool:
        for w in self._works:
            w.wait()
        for host, target in self._copies:
            target.copy_(host)
        return True


def send(tensor: torch.Tensor, dst: int, group: Any) -> None:
    """Send ``tensor`` to global rank ``dst`` and wait until it is sent."""
    payload = _host_send(tensor) if staged(tensor, group) else tensor
    dist.isend(payload, dst, group).wait()


def recv(tensor: torch.Tensor, src: int, group: Any) -> None:
    """Receive into ``tensor`` from global rank ``src`` and wait until it has arrived."""
    if staged(tensor, group):
        host = torch.empty(tensor.shape, dtype=tensor.dtype, device="cpu")
        dist.irecv(host, src, group).wait()
        tensor.copy_(host)
    else:
        dist.irecv(tensor, src, group).wait()
