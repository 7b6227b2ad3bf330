"""Merge plans: which parameters are compressed and communicated together.

A plan is defined over *parameters*, never over DDP buckets. DDP rebuilds its buckets after the
first iteration (and again after a restart), so a plan tied to buckets would change what is
compressed together — and therefore the trajectory — whenever the bucket layout changes. Because
our groups are fixed by parameter names and sizes, a resumed run compresses exactly like the
uninterrupted one, and error memory stays attached to the same elements.

Parameters are ordered in *reverse registration order*, which is (approximately) the order in
which backward produces their gradients; a group is processed as soon as every parameter in it
has arrived in some bucket.

Kinds:

``"model"``    every compressible parameter in one group (TopK-SGD, AR-Topk: global selection).
``"layer"``    one group per parameter tensor (LAGS: per-layer, pipelined with backward).
``"threshold"`` consecutive parameters merged until the group holds ``plan_threshold`` elements
               (MGS-SGD; 8192 in its paper).

Parameters with fewer than ``min_compress_numel`` elements (biases, norms) gain nothing from
compression; they form one extra *exact* group sent by a plain allreduce.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Literal

PlanKind = Literal["model", "layer", "threshold"]
PLAN_KINDS: tuple[str, ...] = ("model", "layer", "threshold")


@dataclass(frozen=True)
class Group:
    """One unit of compression and communication.

    Attributes:
        gid: position in the plan (groups are processed in gid order within a bucket arrival).
        param_ids: indices into the engine's parameter list, in flattening order.
        names: parameter names (error memory is keyed by these).
        numels: element count per parameter.
        exact: True for the group of small tensors sent uncompressed.
    """

    gid: int
    param_ids: tuple[int, ...]
    names: tuple[str, ...]
    numels: tuple[int, ...]
    exact: bool = False

    @property
    def numel(self) -> int:
        return sum(self.numels)


@dataclass(frozen=True)
class Plan:
    kind: str
    groups: tuple[Group, ...]

    def signature(self) -> str:
        """Stable hash of the plan; must be identical on every rank."""
        h = hashlib.sha256(self.kind.encode())
        for g in self.groups:
            h.update(repr((g.gid, g.names, g.numels, g.exact)).encode())
        return h.hexdigest()[:16]

    def group_of(self) -> dict[int, int]:
        """param id → group id."""
        return {pid: g.gid for g in self.groups for pid in g.param_ids}


def build_plan(
    names: list[str],
    numels: list[int],
    kind: str = "model",
    threshold: int = 8192,
    min_compress_numel: int = 1024,
    compress: bool = True,
) -> Plan:
    """Build a plan over parameters given in *registration order*.

    Args:
        names, numels: trainable parameters in registration order.
        kind: ``"model"``, ``"layer"`` or ``"threshold"``.
        threshold: minimum elements per group for ``"threshold"``.
        min_compress_numel: tensors smaller than this go to the exact group.
        compress: False puts everything in exact groups (dense compressor).
    """
    if kind not in PLAN_KINDS:
        raise ValueError(f"plan={kind!r} is not a plan kind; use one of {list(PLAN_KINDS)}.")
    order = list(range(len(names)))[::-1]
    big = [i for i in order if compress and numels[i] >= min_compress_numel]
    small = [i for i in order if i not in set(big)]
    chunks: list[list[int]] = []
    if big:
        if kind == "model":
            chunks = [big]
        elif kind == "layer":
            chunks = [[i] for i in big]
        else:
            cur: list[int] = []
            size = 0
            for i in big:
                cur.append(i)
                size += numels[i]
                if size >= threshold:
                    chunks.append(cur)
                    cur, size = [], 0
            if cur:
                chunks.append(cur)
    groups = []
    for ids in chunks:
        groups.append(Group(len(groups), tuple(ids), tuple(names[i] for i in ids), tuple(numels[i] for i in ids)))
    if small:
        groups.append(
            Group(len(groups), tuple(small), tuple(names[i] for i in small), tuple(numels[i] for i in small), exact=True)
        )
    return Plan(kind, tuple(groups))
