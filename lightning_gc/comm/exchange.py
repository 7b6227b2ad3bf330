"""Exchanges: compressor + collective = one group's trip across the ranks.

An exchange takes the error-fed flat gradient ``p`` of one group on every rank and returns

* ``mean``  — the aggregated gradient (identical on every rank), and
* ``sent``  — what *this* rank's contribution stood for, decompressed (error feedback keeps
  ``p − sent``), or a :class:`SparseSent` when that is exactly ``p`` at some indices, or a
  :class:`LazySent` that knows ‖sent‖² and builds the dense tensor only when asked.

Threading contract (engine v2): the engine calls :meth:`Exchange.run` on exactly one thread per
process group — its ordered worker thread, or the hook's thread when ``overlap=False`` — in the
same order on every rank. ``run`` may issue any number of blocking collectives or P2P operations
on ``self.group`` (the engine's dedicated exchange group), but it must issue the same sequence,
with the same sizes, on every rank: every size must follow from replicated values (the group
size, the ratio, the step, an agreed network model).

Capabilities are class attributes of :class:`Exchange`, each explained there (``formats``,
``needs_network``, ``summable``, ``ring_combinable``, ``carries_exact``, ``carries_report``): declared,
never discovered with ``hasattr``.

The registry of names users pass as ``collective=`` lives above this module, with the compressed
exchanges: :mod:`lightning_gc.exchanges.registry`.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, ClassVar

import torch
import torch.distributed as dist
from torch import Tensor

from ..compressors.base import Compressor, GroupContext
from .collectives import allgather_payload, allreduce
from .network import NetworkState


@dataclass
class SparseSent:
    """What a rank contributed, when it is exactly its input at ``indices`` (sparse formats).

    Lets the engine update error memory in place (zero those positions) and get ‖sent‖² from the
    k values, instead of materialising and subtracting a dense tensor.
    """

    values: Tensor
    indices: Tensor


@dataclass
class LazySent:
    """What a rank contributed, known by its squared norm; the dense tensor is built on demand.

    For formats whose decompression costs as much as their compression (GradiVeQ's ``U z + μ̄``,
    a K×d product per slice), ‖sent‖² follows from the coefficients alone. The engine needs the
    norm every step (compression gain) but the dense tensor only for error feedback, so without
    error feedback the expansion is never computed. ``materialise`` must be called on the thread
    that ran the exchange, before the exchange's next call.

    ``subtract_from`` (optional): writes ``target − sent`` into ``target`` in place without
    building ``sent`` (``lowrank``: one fused ``addmm`` per matrix, ``target − P̂·Q_ownᵀ``, where
    building ``sent`` and subtracting it would be two passes over the group and a group-sized
    temporary); :func:`error_feedback_residual` prefers it.
    """

    sq_norm: float
    materialise: Callable[[], Tensor]
    subtract_from: Callable[[Tensor], Tensor] | None = None




#: what a rank's contribution stood for, in one of its three forms
Sent = Tensor | SparseSent | LazySent


def sq_norm(t: Tensor) -> float:
    """‖t‖² in fp32 without materialising t² (pow(2).sum() allocates a group-sized temporary)."""
    return float(torch.linalg.vector_norm(t, dtype=torch.float32)) ** 2


def sent_sq_norm(sent: Sent) -> float:
    """‖sent‖² of a contribution in any form (the compression gain's numerator)."""
    if isinstance(sent, SparseSent):
        return sq_norm(sent.values)
    if isinstance(sent, LazySent):
        return sent.sq_norm
    return sq_norm(sent)


def error_feedback_residual(p: Tensor, sent: Sent, in_place: bool) -> Tensor:
    """The error-feedback residual ``p − sent``: what was not sent, kept for the next step.

    The one place this arithmetic lives (the engine's groups, OSP's compressed deferred stage and
    OMGS's timed group job use it). ``in_place=True`` reuses ``p`` (a fresh tensor the caller owns);
    a :class:`SparseSent` zeroes ``p`` at the sent indices (exact: sent == p there), a
    :class:`LazySent` subtracts itself (``subtract_from``) or is expanded only here."""
    target = p if in_place else p.clone()
    if isinstance(sent, SparseSent):
        return target.index_fill_(0, sent.indices.long(), 0)
    if isinstance(sent, LazySent) and sent.subtract_from is not None:
        return sent.subtract_from(target)
    dense = sent.materialise() if isinstance(sent, LazySent) else sent
    if dense.data_ptr() == target.data_ptr():  # the exchange sent p itself (lossless): nothing left
        return target - dense
    return target.sub_(dense)


@dataclass
class ExchangeTimes:
    """What one step's exchanges did on this rank: wall-clock split, bytes, and the typed facts
    that particular exchanges report (the engine copies them into its step statistics).

    Attributes:
        compress_s, comm_s: seconds in codec work and inside collectives.
        bytes_sent: bytes this rank put on the wire; bytes_payload: the compressed payload's size.
        bytes_inter_node: the part of ``bytes_sent`` that crossed between nodes, under
            ``topology="nodes"`` (lightning_gc/comm/hierarchy.py); 0 on a flat topology.
        choices: collectives chosen per exchange by a model-driven exchange (AR-Topk auto), in order.
        predicted_comm_s: the alpha-beta model's prediction for those choices (summed), if any.
        full_precision: Marsit: True on a full-precision round, False on a one-bit round.
        overlapped_compress_s: codec seconds hidden behind transfers (GradiVeQ's ring).
        metrics: compressor-specific per-step values, logged as ``gc/<key>`` (GradiVeQ's phase, ...).
        malformed: ``None`` (the default): a payload of the wrong size is raised at once, on its
            rank. A list (the engine's steps): the message is recorded here, zeros are sent in its
            place so that no rank waits in the allgather, and the owner stops the step on every rank
            (:func:`~lightning_gc.comm.collectives.allgather_payload`).
    """

    compress_s: float = 0.0
    comm_s: float = 0.0
    bytes_sent: int = 0
    bytes_payload: int = 0
    bytes_inter_node: int = 0  # of bytes_sent, what crossed between nodes (topology="nodes" counts it)
    choices: list[str] = field(default_factory=list)
    predicted_comm_s: float | None = None
    full_precision: bool | None = None
    overlapped_compress_s: float = 0.0
    metrics: dict[str, float] = field(default_factory=dict)
    malformed: list[str] | None = None

    def on_malformed_payload(self) -> Callable[[str], None] | None:
        """What :func:`~lightning_gc.comm.collectives.allgather_payload` calls on a payload of the
        wrong size: record it (see ``malformed``), or ``None`` to raise."""
        return self.malformed.append if self.malformed is not None else None

    def raise_if_malformed_anywhere(self, group: Any, device: torch.device, world_size: int, what: str,
                                    compressor: str, consequence: str) -> None:
        """After an exchange run with ``malformed=[]``, outside the engine's steps (DiLoCo's outer
        exchange, OSP's deferred stage): agree across ``group`` (a 1-element allreduce, called on
        every rank) on how many ranks produced a payload of the wrong size, and raise on every rank if
        any did. ``what`` names the payload, ``consequence`` what is not done."""
        flag = torch.tensor([1.0 if self.malformed else 0.0], device=device)
        dist.all_reduce(flag, group=group)
        if flag.item() > 0:
            here = f"this rank's: {self.malformed[0]}" if self.malformed else "not this rank's"
            raise RuntimeError(
                f"{int(flag.item())} of {world_size} ranks produced {what} of another size than the compressor declares "
                f"({here}); {consequence} This is a bug of the compressor {compressor!r}: report it.")

    def add_choice(self, collective: str, predicted_s: float | None) -> None:
        """Record a model-chosen collective and its predicted time."""
        self.choices.append(collective)
        if predicted_s is not None:
            self.predicted_comm_s = (self.predicted_comm_s or 0.0) + predicted_s

    @property
    def extra(self) -> Mapping[str, Any]:
        """Read-only view of the typed facts that were reported (for older readers; writing to
        it raises: set the typed attributes)."""
        out: dict = {}
        if self.choices:
            out["choices"] = list(self.choices)
        if self.predicted_comm_s is not None:
            out["predicted_comm_s"] = self.predicted_comm_s
        if self.full_precision is not None:
            out["full_precision"] = self.full_precision
        if self.overlapped_compress_s:
            out["overlapped_compress_s"] = self.overlapped_compress_s
        if self.metrics:
            out["metrics"] = self.metrics
        return MappingProxyType(out)


class Timer:
    """Accumulates compute and communication time into an :class:`ExchangeTimes`.

    On CPU it reads the wall clock around each call. On CUDA it records a pair of events on the
    current stream instead of synchronising the device (no ``torch.cuda.synchronize`` on the hot
    path); :meth:`resolve` turns the recorded pairs into seconds once the step's work is done.
    """

    def __init__(self, device: torch.device, times: ExchangeTimes) -> None:
        self.device = device
        self.times = times
        self._events: list[tuple[str, Any, Any]] = []

    def _add(self, kind: str, dt: float) -> None:
        if kind == "comm":
            self.times.comm_s += dt
        else:
            self.times.compress_s += dt

    def run(self, kind: str, fn: Callable):
        if self.device.type == "cuda":
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            start.record()
            out = fn()
            end.record()
            self._events.append((kind, start, end))
            return out
        t0 = time.perf_counter()
        out = fn()
        self._add(kind, time.perf_counter() - t0)
        return out

    def resolve(self) -> None:
        """Fold recorded CUDA event pairs into the times (waits for those events only)."""
        for kind, start, end in self._events:
            end.synchronize()
            self._add(kind, start.elapsed_time(end) / 1e3)
        self._events.clear()


class Exchange(ABC):
    """One way of moving a compressor's payload. Subclasses declare their capabilities."""

    #: name users pass as ``collective=...`` (set by the registry for parameterised classes)
    name: str = ""
    #: compressor wire formats this exchange carries
    formats: ClassVar[frozenset[str]] = frozenset()
    #: takes decisions from the network model (the engine hands it the shared NetworkState, kept probed)
    needs_network: ClassVar[bool] = False
    #: payloads are combined by element-wise sums
    summable: ClassVar[bool] = False
    #: payloads are combined hop by hop along our P2P ring
    ring_combinable: ClassVar[bool] = False
    #: :meth:`run_with_exact` sends a group's exact tensors inside this exchange's own first
    #: collective (one collective per step fewer than a separate exact group; docs/concepts.md)
    carries_exact: ClassVar[bool] = False
    #: :meth:`run_riding` sends the step's closing report inside this exchange's last collective (one
    #: latency-bound collective per step fewer; lightning_gc/engine/agreement.py, RiddenReport)
    carries_report: ClassVar[bool] = False

    def __init__(self, compressor: Compressor, group=None, network: NetworkState | None = None) -> None:
        self.compressor = compressor
        self.group = group
        self.network = network if network is not None else NetworkState()

    def _require(self, compressor: Compressor, cls: type[Compressor], runs: str) -> None:
        """Refuse a compressor other than ``cls`` (exchanges written for one compressor's format)."""
        if not isinstance(compressor, cls):
            raise ValueError(
                f"collective={self.name!r} runs {runs} and needs compressor={cls.name!r}, "
                f"got {getattr(compressor, 'name', compressor)!r}."
            )

    @abstractmethod
    def run(self, p: Tensor, ctx: GroupContext, timer: Timer) -> tuple[Tensor, Tensor | SparseSent | LazySent]:
        """Return (mean over ranks, this rank's contribution: dense, :class:`SparseSent` or :class:`LazySent`)."""

    def run_with_exact(self, p: Tensor, ctx: GroupContext, timer: Timer,
                       exact: Tensor) -> tuple[Tensor, Tensor | SparseSent | LazySent, Tensor]:
        """:meth:`run`, with ``exact`` (the flat tensors of the plan's exact group, fp32) summed
        exactly and divided by N in the same message: returns (mean, sent, mean of ``exact``).
        Only for exchanges with ``carries_exact``; the engine never calls it on the others."""
        raise NotImplementedError(f"collective {self.name!r} does not carry exact tensors (carries_exact=False)")

    def report_dtype(self) -> torch.dtype | None:
        """The dtype :meth:`run_riding` sends the report in (its last message's), None if it cannot."""
        return None

    def run_riding(self, p: Tensor, ctx: GroupContext, timer: Timer, exact: Tensor | None,
                   report: Callable[[Tensor], Tensor]) -> tuple[Tensor, Tensor, Tensor | None, Tensor]:
        """:meth:`run` (or :meth:`run_with_exact` with ``exact``), with the step's closing report in the
        last collective: just before it, ``report(sent)`` (this rank's ``sent``, dense) returns this
        rank's share (a flat fp32 tensor), which is summed over the ranks, *not* divided by N, in the
        message's dtype. Returns (mean, sent, mean of ``exact`` or None, the summed share in fp32).
        Only for exchanges with ``carries_report``; the engine never calls it on the others."""
        raise NotImplementedError(f"collective {self.name!r} does not carry the closing report (carries_report=False)")

    def describe(self) -> str:
        """Name and options; part of the cross-rank signature."""
        return self.name

    def state_dict(self) -> dict:
        """State that must survive a checkpoint (e.g. AR-Topk VAR's smoothed energies); none here."""
        return {}

    def load_state_dict(self, state: dict, world_size: int | None = None) -> None:
        """Restore :meth:`state_dict`; ``world_size`` is the current group size (state written on
        another number of ranks may not apply)."""
        return None


class AllreduceExchange(Exchange):
    """Linear payloads summed by the backend's allreduce (:meth:`_reduce` may be overridden)."""

    name = "allreduce"
    formats = frozenset({"allreduce"})
    summable = True

    def _reduce(self, tensors: list[Tensor]) -> int:
        """Sum-allreduce each tensor in place; returns the bytes this rank sent."""
        return allreduce(tensors, self.group, self.network.model)

    def run(self, p: Tensor, ctx: GroupContext, timer: Timer) -> tuple[Tensor, Tensor]:
        c = self.compressor
        comp = timer.run("compress", lambda: c.compress(p, ctx))
        sent = timer.run("compress", lambda: c.decompress(comp.payload, comp.meta, ctx))
        timer.times.bytes_payload += comp.nbytes
        payload = [t.clone() for t in comp.payload]
        timer.times.bytes_sent += timer.run("comm", lambda: self._reduce(payload))
        mean = timer.run("compress", lambda: c.aggregate_summed(tuple(payload), comp.meta, ctx))
        return mean, sent


class RingAllreduceExchange(AllreduceExchange):
    """Summable payloads over our P2P ring allreduce (a schedule we know and can model)."""

    name = "ring"
    ring_combinable = True

    def _reduce(self, tensors: list[Tensor]) -> int:
        from .p2p_allreduce import ring_allreduce

        return sum(ring_allreduce(t, group=self.group).bytes_sent for t in tensors)


class TreeAllreduceExchange(AllreduceExchange):
    """Summable payloads over our P2P tree allreduce."""

    name = "tree"

    def _reduce(self, tensors: list[Tensor]) -> int:
        from .p2p_allreduce import tree_allreduce

        return sum(tree_allreduce(t, group=self.group).bytes_sent for t in tensors)


class AllgatherExchange(Exchange):
    """Fixed-size payloads gathered from every rank in one allgather of a byte buffer."""

    name = "allgather"
    formats = frozenset({"allgather"})

    def run(self, p: Tensor, ctx: GroupContext, timer: Timer) -> tuple[Tensor, Tensor | SparseSent]:
        c = self.compressor
        comp = timer.run("compress", lambda: c.compress(p, ctx))
        specs = c.payload_specs(ctx, p.dtype)
        payloads, nbytes, payload_bytes = timer.run(
            "comm", lambda: allgather_payload(comp.payload, specs, self.group, timer.times.on_malformed_payload())
        )
        timer.times.bytes_sent += nbytes
        timer.times.bytes_payload += payload_bytes
        mean = timer.run("compress", lambda: c.aggregate_gathered(payloads, comp.meta, ctx))
        if c.sends_exact_subset:
            return mean, SparseSent(comp.payload[0], comp.payload[1])
        sent = timer.run("compress", lambda: c.decompress(comp.payload, comp.meta, ctx))
        return mean, sent
