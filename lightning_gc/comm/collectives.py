"""Thin wrappers over torch.distributed collectives with byte accounting.

Byte counts are *modelled* per rank for the algorithms gloo and NCCL use for these calls
(ring allreduce: each rank sends ``2(N−1)/N`` of the message; ring allgather: each rank forwards
``(N−1)`` payloads). The benchmark compares them against the interfaces' transmit counters.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import Tensor

# the payload packing is the compressors' wire layout; imported here for allgather_payload and the
# modules that gather payloads
from ..compressors.packing import pack_payload, packed_nbytes, unpack_payload  # noqa: F401

# the modelled byte counts live with the cost model (the direct exchange below uses them too)
from .cost_model import allgather_bytes, ring_allreduce_bytes  # noqa: F401
from .direct import allgather, allreduce_chosen


def unflatten_into(flat: Tensor, tensors: list[Tensor]) -> None:
    """Copy consecutive slices of ``flat`` into ``tensors``, in order (the inverse of flattening them)."""
    offset = 0
    for t in tensors:
        t.copy_(flat[offset:offset + t.numel()].view_as(t))
        offset += t.numel()


def allreduce(tensors: list[Tensor], group=None, network=None) -> int:
    """Sum-allreduce each tensor in place; returns modelled bytes sent by this rank. A small message
    goes by the direct exchange, the others by the backend's ring (:func:`.direct.use_direct`;
    ``network``: the agreed :class:`~.cost_model.NetworkModel`, or None)."""
    return sum(allreduce_chosen(t, group, network) for t in tensors)


def allgather_payload(payload: tuple[Tensor, ...], specs, group=None,
                      on_mismatch: Callable[[str], None] | None = None) -> tuple[list[tuple[Tensor, ...]], int, int]:
    """All-gather one fixed-size payload per rank in a single collective.

    A payload whose size differs from what every rank expects (a compressor bug: a rank-dependent
    size) cannot take part in the allgather. Without ``on_mismatch`` that is raised here, on this rank
    alone (the other ranks then wait in the collective). With it, ``on_mismatch`` receives the
    message and a payload of zeros of the expected size is sent in its place (zero bytes decode to a
    valid, empty contribution in every format), so every rank completes the collective; the caller
    must then stop the step on every rank (the engine does, through its closing report).

    Returns (payloads of all ranks in rank order, modelled bytes sent, payload bytes).
    """
    buf = pack_payload(payload)
    expected = packed_nbytes(specs)
    if buf.numel() != expected:
        message = (f"payload of {buf.numel()} bytes differs from the {expected} bytes every rank expects; "
                   "a compressor produced a rank-dependent size, which would deadlock the allgather.")
        if on_mismatch is None:
            raise RuntimeError(message)
        on_mismatch(message)
        buf = torch.zeros(expected, dtype=torch.uint8, device=buf.device)
    ws = dist.get_world_size(group)
    bufs = [torch.empty_like(buf) for _ in range(ws)]
    sent = allgather(bufs, buf, group)
    return [unpack_payload(b, specs) for b in bufs], sent, buf.numel()


def descriptor_hash(text: str) -> int:
    return zlib.crc32(text.encode())


def check_descriptor(text: str, step: int, group, world_size: int, device: torch.device, *,
                     at_close: bool = False) -> int:
    """All-gather the hash of ``text``; raise on every rank if ranks differ. Returns bytes sent.

    ``at_close``: the engine's closing report already found that the ranks' hashes differ and every
    rank calls this to name them; the message then says the exchanges were issued (and the step is
    not applied) instead of about to be."""
    mine = torch.tensor([descriptor_hash(text)], dtype=torch.int64, device=device)
    gathered = [torch.empty_like(mine) for _ in range(world_size)]
    allgather(gathered, mine, group)
    hashes = [int(t.item()) for t in gathered]
    if len(set(hashes)) > 1:
        by_hash: dict[int, list[int]] = {}
        for r, h in enumerate(hashes):
            by_hash.setdefault(h, []).append(r)
        what = ("issued different exchanges (found by the step's closing report; the step is not applied and "
                "training stops here on every rank)" if at_close else
                "are about to issue different exchanges and would deadlock or abort")
        raise RuntimeError(
            f"lightning_gc: at step {step} the ranks {what}. Ranks grouped by what they would do: "
            f"{list(by_hash.values())}. This rank's step: {text}. Every rank must run the same plan, compressor "
            "options, ratio, collective and step counter; change the ratio or plan only through GCEngine.set_ratio / "
            "replace_plan (which check the ranks agree), and resume every rank from the same checkpoint."
            + ("" if not at_close else " To stop before the exchanges instead, pass check_every=1 (an opening "
               "check before every step).")
        )
    return allgather_bytes(8, world_size)
