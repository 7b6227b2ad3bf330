"""Merge plans: which parameters are compressed and communicated together.

A plan is defined over *parameters*, never over DDP buckets. DDP rebuilds its buckets after the
first iteration (and again after a restart), so a plan tied to buckets would change what is
compressed together — and therefore the trajectory — whenever the bucket layout changes. Because
our groups are fixed by parameter names and sizes, a resumed run compresses exactly like the
uninterrupted one, and error memory stays attached to the same elements.

Parameters are ordered in *reverse registration order*, which is (approximately) the order in
which backward produces their gradients; a group is processed as soon as every parameter in it
has arrived in some bucket.

A *planner* turns per-parameter facts (:class:`ParamFacts`: name, size, and — for planners that
use them — a measured backward time) plus an optional network model into a :class:`Plan`.
Planners are looked up by name in a registry (:func:`register_planner`, :func:`get_planner`), so a
new planner (e.g. an optimal merge under a cost model) is one module that registers itself.
Parameters with fewer than ``min_compress_numel`` elements (biases, norms) gain nothing from
compression; every planner puts them into one extra *exact* group sent by a plain allreduce.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any


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


@dataclass(frozen=True)
class ParamFacts:
    """What a planner may know about one trainable parameter.

    Attributes:
        pid: index in the engine's parameter list (registration order).
        name: parameter name (``module.named_parameters()``).
        numel: number of elements.
        backward_s: measured time from the start of backward until this gradient is ready, if a
            profiler measured it (``None`` for static planners).
    """

    pid: int
    name: str
    numel: int
    backward_s: float | None = None


@dataclass(frozen=True)
class PlanRequest:
    """Everything a planner gets: parameters in registration order, options and the network.

    Attributes:
        params: one :class:`ParamFacts` per trainable parameter, in registration order.
        threshold: elements per merged group (``"threshold"`` planner).
        min_compress_numel: tensors smaller than this go to the exact group.
        compress: False puts everything into the exact group (lossless compressor).
        network: the network model in force (``NetworkModel`` or ``None``), for cost-based planners.
        cost: a fitted cost model for cost-based planners (``OMGSCost`` for ``"omgs"``), or ``None``.
    """

    params: tuple[ParamFacts, ...]
    threshold: int = 8192
    min_compress_numel: int = 1024
    compress: bool = True
    network: Any = None
    cost: Any = None

    def backward_order(self) -> list[ParamFacts]:
        """Parameters in (approximate) gradient-ready order: reverse registration order."""
        return list(self.params)[::-1]

    def split_small(self) -> tuple[list[ParamFacts], list[ParamFacts]]:
        """(compressible, exact) parameters, both in backward order."""
        order = self.backward_order()
        big = [p for p in order if self.compress and p.numel >= self.min_compress_numel]
        big_ids = {p.pid for p in big}
        return big, [p for p in order if p.pid not in big_ids]


_PLANNERS: dict[str, Callable[[PlanRequest], Plan]] = {}
_SUMMARIES: dict[str, str] = {}


def register_planner(name: str, planner: Callable[[PlanRequest], Plan], summary: str = "") -> None:
    """Make ``plan=name`` available to GCStrategy / EngineConfig (``summary``: one line for listings)."""
    if name in _PLANNERS and _PLANNERS[name] is not planner:
        raise ValueError(f"a planner named {name!r} is already registered")
    _PLANNERS[name] = planner
    _SUMMARIES[name] = summary


def available_planners() -> list[str]:
    return list(_PLANNERS)


def planner_summaries() -> dict[str, str]:
    """name → one-line summary."""
    return dict(_SUMMARIES)


def get_planner(name: str) -> Callable[[PlanRequest], Plan]:
    if not isinstance(name, str) or name not in _PLANNERS:
        raise ValueError(
            f"plan={name!r} is not a plan kind: use one of {available_planners()} ('model' = whole model in one group)."
        )
    return _PLANNERS[name]


def assemble_plan(kind: str, chunks: Sequence[Sequence[ParamFacts]], exact: Sequence[ParamFacts]) -> Plan:
    """Number the compressed chunks, append the exact group, and return the plan."""
    groups = []
    for chunk in chunks:
        groups.append(Group(len(groups), tuple(p.pid for p in chunk), tuple(p.name for p in chunk),
                            tuple(p.numel for p in chunk)))
    if exact:
        groups.append(Group(len(groups), tuple(p.pid for p in exact), tuple(p.name for p in exact),
                            tuple(p.numel for p in exact), exact=True))
    return Plan(kind, tuple(groups))


def build_plan(
    names: list[str],
    numels: list[int],
    kind: str = "model",
    threshold: int = 8192,
    min_compress_numel: int = 1024,
    compress: bool = True,
    backward_s: list[float] | None = None,
    network: Any = None,
    cost: Any = None,
) -> Plan:
    """Build a plan over parameters given in *registration order* with the planner ``kind``."""
    params = tuple(
        ParamFacts(i, n, k, None if backward_s is None else backward_s[i]) for i, (n, k) in enumerate(zip(names, numels))
    )
    request = PlanRequest(params, threshold=threshold, min_compress_numel=min_compress_numel,
                          compress=compress, network=network, cost=cost)
    return get_planner(kind)(request)
