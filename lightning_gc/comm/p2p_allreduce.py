"""Ring and binomial-tree allreduce built from ``torch.distributed`` point-to-point operations.

Why not ``dist.all_reduce``? Two reasons:

1. **Pluggable combine.** Some compressors reduce *compressed* data hop by hop (e.g. one-bit
   signs merged with a Bernoulli rule at every ring hop); NCCL and gloo only offer
   sum/prod/min/max. Here the reduction is a Python callable
   ``combine(acc_chunk, incoming_chunk, hop)``.
2. **A schedule we know.** AR-Topk must really run a ring *or* a tree (the cost model, rules
   5a-5c, predicts which is cheaper); a backend's ``all_reduce`` picks its own algorithm. Both
   functions here return the exact number of bytes this rank sent, so the engine can account
   communication volume without guessing.

Both work on any backend: they send through :mod:`lightning_gc.comm.p2p`, which calls
``isend``/``irecv``/``batch_isend_irecv`` directly where the backend sends the tensor's device point
to point (gloo with CPU tensors, NCCL with CUDA tensors) and stages each message through host memory
where it does not (gloo with CUDA tensors).

Semantics shared by both functions:

* In place: the result (the *sum* over ranks, or whatever ``combine`` computes) overwrites
  ``tensor``. Any shape is accepted as long as the tensor is contiguous; it is reduced as its flat
  view ``tensor.view(-1)`` (element-wise, so the shape does not matter). A non-contiguous tensor is
  rejected (a flat view of it would be a copy and the result would be lost).
* Results are bit-identical on all ranks: every element is reduced by exactly one rank (the chunk
  owner in the ring, the root in the tree) and then copied to the others. Integer sums match
  ``dist.all_reduce`` bit for bit (two's-complement addition is associative); floating-point sums
  match it up to summation order.
* ``group`` may be any process group this rank belongs to; ranks inside the algorithm are *group*
  ranks, translated to global ranks with ``dist.get_global_rank`` for the P2P calls.
* World size 1 is a no-op (nothing sent, ``combine`` never called).
* Every rank of ``group`` must call with the same numel, dtype and algorithm (as for any
  collective), otherwise ranks wait for messages that never come.

The ``combine`` contract: ``combine(acc_chunk, incoming_chunk, hop)`` receives this rank's
accumulator chunk (a view into ``tensor``) and a received chunk of the same shape and dtype;
``hop`` is the number of ranks whose data ``incoming_chunk`` already aggregates (``acc_chunk``
holds this rank's own data, possibly already combined with others). It must either update
``acc_chunk`` in place and return ``None`` (or ``acc_chunk``), or return a new tensor of the same
shape, which is copied into ``acc_chunk``. The default adds in place. A sign-merging compressor
whose rule is stated with "at hop m the incoming data aggregates m-1 ranks" uses ``m = hop + 1``.
``combine`` must be deterministic given its inputs and any shared-seed generator, because the
reduced chunk it produces is what all ranks receive.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import torch
import torch.distributed as dist

from . import p2p

__all__ = [
    "Combine",
    "P2PAllreduceStats",
    "ring_allreduce",
    "tree_allreduce",
    "ring_chunk_sizes",
    "ring_bytes_sent",
    "tree_bytes_sent",
    "tree_children",
    "tree_depth",
    "tree_parent",
    "tree_subtree_size",
]

Combine = Callable[[torch.Tensor, torch.Tensor, int], "torch.Tensor | None"]


@dataclass(frozen=True)
class P2PAllreduceStats:
    """What one rank did during one P2P allreduce.

    Attributes:
        algorithm: ``"ring"`` or ``"tree"``.
        world_size: size of the group the allreduce ran on.
        bytes_sent: payload bytes this rank sent (exact, counts uneven chunks).
        bytes_received: payload bytes this rank received.
        messages_sent: number of non-empty sends by this rank (the ``alpha`` count of the model).
        combine_calls: how many times ``combine`` ran on this rank.
    """

    algorithm: Literal["ring", "tree"]
    world_size: int
    bytes_sent: int
    bytes_received: int
    messages_sent: int
    combine_calls: int


def _default_combine(acc: torch.Tensor, incoming: torch.Tensor, hop: int) -> None:
    acc.add_(incoming)


def _apply_combine(combine: Combine, acc: torch.Tensor, incoming: torch.Tensor, hop: int) -> None:
    out = combine(acc, incoming, hop)
    if out is None or out is acc:
        return
    if not isinstance(out, torch.Tensor) or out.shape != acc.shape:
        raise TypeError(
            f"combine returned {type(out).__name__} with shape "
            f"{getattr(out, 'shape', None)} for an accumulator chunk of shape {tuple(acc.shape)}; "
            "combine must update acc_chunk in place and return None, or return a tensor of the "
            "same shape"
        )
    acc.copy_(out)


def _prepare(tensor: torch.Tensor, group: dist.ProcessGroup | None, fn: str) -> tuple[torch.Tensor, int, int]:
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{fn}: tensor={type(tensor).__name__} is not a torch.Tensor; pass a tensor")
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(
            f"{fn}: torch.distributed is not initialized; call torch.distributed.init_process_group "
            "first (or skip the call when running on one process)"
        )
    rank = dist.get_rank(group)
    if rank < 0:
        raise ValueError(
            f"{fn}: this process (global rank {dist.get_rank()}) is not a member of group={group!r}; "
            "call the allreduce only on ranks that belong to the group"
        )
    if not tensor.is_contiguous():
        raise ValueError(
            f"{fn}: tensor with shape {tuple(tensor.shape)} and stride {tensor.stride()} is not "
            "contiguous, so the in-place result could not be written back through a flat view; "
            "pass t.contiguous() and copy the result back"
        )
    return tensor.view(-1), rank, dist.get_world_size(group)


# --------------------------------------------------------------------------------------------
# ring
# --------------------------------------------------------------------------------------------
def ring_chunk_sizes(numel: int, world_size: int) -> list[int]:
    """Chunk sizes of the ring: the first ``numel % N`` chunks get one extra element.

    Chunks may be empty when ``numel < N``; empty chunks are never sent.
    """
    if world_size < 1 or numel < 0:
        raise ValueError(
            f"numel={numel!r}, world_size={world_size!r}: need numel >= 0 and world_size >= 1"
        )
    q, r = divmod(numel, world_size)
    return [q + (1 if i < r else 0) for i in range(world_size)]


def ring_bytes_sent(numel: int, element_size: int, world_size: int, rank: int) -> int:
    """Exact bytes group rank ``rank`` sends in :func:`ring_allreduce`.

    Reduce-scatter step ``s`` sends chunk ``(rank - s) % N`` and allgather step ``s`` sends chunk
    ``(rank + 1 - s) % N``, for ``s = 0 .. N-2``; about ``2*(N-1)/N * numel * element_size``.
    """
    n = world_size
    if n == 1:
        return 0
    sizes = ring_chunk_sizes(numel, n)
    sent = sum(sizes[(rank - s) % n] for s in range(n - 1))
    sent += sum(sizes[(rank + 1 - s) % n] for s in range(n - 1))
    return sent * element_size


def ring_allreduce(
    tensor: torch.Tensor,
    group: dist.ProcessGroup | None = None,
    combine: Combine | None = None,
) -> P2PAllreduceStats:
    """Ring allreduce (reduce-scatter then allgather) of ``tensor`` in place over ``group``.

    The flat tensor is split into ``N`` chunks (sizes from :func:`ring_chunk_sizes`; any numel,
    including ``numel < N``). Reduce-scatter: at step ``s = 0 .. N-2`` group rank ``r`` sends chunk
    ``(r - s) % N`` to ``r + 1`` and receives chunk ``(r - s - 1) % N`` from ``r - 1``, which it
    combines into its own copy with ``hop = s + 1`` (the incoming chunk aggregates ``s + 1``
    ranks). After ``N - 1`` steps rank ``r`` owns the fully reduced chunk ``(r + 1) % N``.
    Allgather: ``N - 1`` steps pass the reduced chunks around the ring, overwriting.

    ``combine`` is called exactly ``N - 1`` times per rank with hops ``1, 2, ..., N-1`` in that
    order -- also for empty chunks (with empty tensors), so a stateful combine sees the same call
    sequence on every rank.

    Cost (model): ``2(N-1)`` messages and ``~2(N-1)/N * M`` bytes per rank, the Ring-AR row of
    Table I; the returned :class:`P2PAllreduceStats` has the exact counts.

    Each step posts its send and receive together with ``batch_isend_irecv`` (all ranks take part
    in every step), which is required for NCCL, where a lone blocking send to a neighbour that is
    itself sending first would deadlock.
    """
    flat, rank, n = _prepare(tensor, group, "ring_allreduce")
    if n == 1:
        return P2PAllreduceStats("ring", 1, 0, 0, 0, 0)
    combine = combine or _default_combine
    sizes = ring_chunk_sizes(flat.numel(), n)
    offsets = [0]
    for s in sizes[:-1]:
        offsets.append(offsets[-1] + s)

    def chunk(i: int) -> torch.Tensor:
        return flat.narrow(0, offsets[i], sizes[i])

    right = dist.get_global_rank(group, (rank + 1) % n) if group is not None else (rank + 1) % n
    left = dist.get_global_rank(group, (rank - 1) % n) if group is not None else (rank - 1) % n
    esize = flat.element_size()
    recv_buf = torch.empty(max(sizes), dtype=flat.dtype, device=flat.device)
    sent = received = msgs = calls = 0

    def exchange(send: torch.Tensor, recv: torch.Tensor) -> None:
        nonlocal sent, received, msgs
        if send.numel() > 0:
            sent += send.numel() * esize
            msgs += 1
        if recv.numel() > 0:
            received += recv.numel() * esize
        for work in p2p.batch_send_recv(send if send.numel() > 0 else None, right,
                                        recv if recv.numel() > 0 else None, left, group):
            work.wait()

    # reduce-scatter
    for s in range(n - 1):
        send_idx = (rank - s) % n
        recv_idx = (rank - s - 1) % n
        incoming = recv_buf[: sizes[recv_idx]]
        exchange(chunk(send_idx), incoming)
        _apply_combine(combine, chunk(recv_idx), incoming, s + 1)
        calls += 1
    # allgather
    for s in range(n - 1):
        exchange(chunk((rank + 1 - s) % n), chunk((rank - s) % n))
    return P2PAllreduceStats("ring", n, sent, received, msgs, calls)


# --------------------------------------------------------------------------------------------
# tree
# --------------------------------------------------------------------------------------------
def tree_depth(world_size: int) -> int:
    """Rounds of each phase of :func:`tree_allreduce` (and of :func:`binomial_broadcast`):
    ``ceil(log2 N)``, 0 for ``N == 1``."""
    if world_size < 1:
        raise ValueError(f"world_size={world_size!r} must be >= 1")
    return (world_size - 1).bit_length()


def tree_parent(rank: int) -> int | None:
    """Parent of group rank ``rank`` in the binomial tree rooted at 0 (``None`` for the root):
    ``rank`` minus its lowest set bit (e.g. 6 -> 4, 5 -> 4, 4 -> 0)."""
    return None if rank == 0 else rank - (rank & -rank)


def tree_children(rank: int, world_size: int) -> list[int]:
    """Children of group rank ``rank`` in the binomial tree, in the order of the reduce rounds.

    Child ``rank + 2**j`` for every ``j`` below the position of ``rank``'s lowest set bit (every
    ``j`` for the root) with ``rank + 2**j < world_size``; in round ``j`` of the reduce, child
    ``rank + 2**j`` sends to ``rank``.
    """
    limit = tree_depth(world_size) if rank == 0 else (rank & -rank).bit_length() - 1
    return [rank + (1 << j) for j in range(limit) if rank + (1 << j) < world_size]


def tree_subtree_size(rank: int, world_size: int) -> int:
    """Ranks in the subtree of ``rank`` (itself included): ``min(lowbit(rank), N - rank)``, N for the root."""
    if rank == 0:
        return world_size
    return min(rank & -rank, world_size - rank)


def tree_bytes_sent(numel: int, element_size: int, world_size: int, rank: int) -> int:
    """Exact bytes group rank ``rank`` sends in :func:`tree_allreduce`.

    One full message up to the parent (all ranks but the root) and one full message down to each
    child: ``(has_parent + n_children) * numel * element_size``.
    """
    if world_size == 1 or numel == 0:
        return 0
    n_msgs = (0 if rank == 0 else 1) + len(tree_children(rank, world_size))
    return n_msgs * numel * element_size


def tree_allreduce(
    tensor: torch.Tensor,
    group: dist.ProcessGroup | None = None,
    combine: Combine | None = None,
) -> P2PAllreduceStats:
    """Binomial-tree allreduce of ``tensor`` in place: reduce to group rank 0, broadcast back.

    The tree (see :func:`tree_parent`, :func:`tree_children`) is the binomial tree rooted at 0.
    Reduce phase, rounds ``j = 0 .. L-1`` with ``L = ceil(log2 N)`` (:func:`tree_depth`): the ranks
    whose lowest set bit is ``2**j`` send their partial result to ``rank - 2**j``, which combines it
    into its own data with ``hop`` = the sender's subtree size. Broadcast phase: the same tree in
    reverse, ``L`` rounds, the root's result overwriting everyone's data.

    Every rank sends and receives at most one full message per round, so each phase takes ``L``
    message times of ``M`` bytes: ``2*L*(alpha + M*beta)`` in all, the Tree-AR row of Table I with
    ``L = ceil(log2 N)`` (``log2 N`` for powers of two). The root receives ``L`` messages and sends
    ``L``; a leaf sends one and receives one. Bytes sent per rank:
    ``(has_parent + n_children) * numel * element_size`` (see :func:`tree_bytes_sent`).

    ``combine`` is called once per child, children in round order (``rank + 1`` first, then
    ``rank + 2``, ``rank + 4``, ...), with ``hop`` = the child's subtree size
    (:func:`tree_subtree_size`), so a rank's accumulator after its last combine aggregates its
    whole subtree and the root's aggregates all ``N`` ranks.

    Empty tensors return immediately (nothing to reduce, ``combine`` is not called) on every rank.
    Uses plain ``isend``/``irecv`` pairs: each transfer involves only two ranks, and a rank never
    sends and receives on the same edge at the same time.
    """
    flat, rank, n = _prepare(tensor, group, "tree_allreduce")
    if n == 1 or flat.numel() == 0:
        return P2PAllreduceStats("tree", n, 0, 0, 0, 0)
    combine = combine or _default_combine

    def glob(r: int) -> int:
        return dist.get_global_rank(group, r) if group is not None else r

    nbytes = flat.numel() * flat.element_size()
    children = tree_children(rank, n)
    parent = tree_parent(rank)
    sent = received = msgs = calls = 0

    # reduce up: one child per round, in round order
    if children:
        buf = torch.empty_like(flat)
        for ch in children:
            p2p.recv(buf, glob(ch), group)
            received += nbytes
            _apply_combine(combine, flat, buf, tree_subtree_size(ch, n))
            calls += 1
        del buf
    if parent is not None:
        p2p.send(flat, glob(parent), group)
        sent += nbytes
        msgs += 1
        # broadcast down: receive the final result from the parent
        p2p.recv(flat, glob(parent), group)
        received += nbytes
    # broadcast down: the child of the highest round first (it has the deepest subtree)
    for ch in reversed(children):
        p2p.send(flat, glob(ch), group)
        sent += nbytes
        msgs += 1
    return P2PAllreduceStats("tree", n, sent, received, msgs, calls)


# --------------------------------------------------------------------------------------------
# binomial-tree broadcast
# --------------------------------------------------------------------------------------------
def binomial_broadcast(tensor: torch.Tensor, src: int, group: dist.ProcessGroup | None = None) -> int:
    """Broadcast ``tensor`` from group rank ``src`` along a binomial tree, P2P; returns bytes sent.

    In round j (j = 0, 1, …, ⌈log2 N⌉−1) every rank that already holds the data and whose rank
    relative to ``src`` is below 2^j sends it to relative rank + 2^j. The source sends ⌈log2 N⌉
    messages and the whole broadcast takes ⌈log2 N⌉ rounds — the ``log N`` broadcast term of the
    alpha-beta model (Eq. 4a/4b) — whereas a flat one-to-all broadcast (gloo's) pushes N−1 copies
    through the source's link.
    """
    flat, rank, n = _prepare(tensor, group, "binomial_broadcast")
    if n == 1:
        return 0
    if not 0 <= src < n:
        raise ValueError(f"binomial_broadcast: src={src} is not a rank of a group of {n}; pass 0 ≤ src < {n}")

    def glob(r: int) -> int:
        return dist.get_global_rank(group, r) if group is not None else r

    rel = (rank - src) % n
    sent = 0
    step = 1
    while step < n:
        if rel < step and rel + step < n:
            p2p.send(flat, glob((rel + step + src) % n), group)
            sent += flat.numel() * flat.element_size()
        elif step <= rel < 2 * step:
            p2p.recv(flat, glob((rel - step + src) % n), group)
        step *= 2
    return sent
