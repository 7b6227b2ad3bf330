"""The alpha-beta communication cost model, in one place.

Every prediction of communication time in ``lightning_gc`` comes from this module, so the engine,
the controller and the benchmarks cannot drift apart. The model (Hockney's alpha-beta model, as
used in Table I and Eq. 4a/4b of the AR-Topk paper) charges

* ``alpha`` seconds per message (latency: software stack + wire), and
* ``beta`` seconds per byte (inverse bandwidth),

for each step of a collective's schedule. All functions take

* ``alpha`` -- seconds per message, ``>= 0``;
* ``beta`` -- seconds per byte, ``>= 0`` (``8 / bits_per_second``);
* ``M`` -- bytes of the message: for the dense collectives the bytes each rank contributes; for
  the sparse collectives ``4 * numel`` of the group, whatever the gradient's dtype (so ``M * c``
  is the byte size of the kept int32 indices, ``k = ceil(c * numel)``); ``>= 0``;
* ``N`` -- number of ranks, an integer ``>= 1``;
* ``c`` -- compression ratio, the fraction of elements kept, ``0 <= c <= 1``;
* ``value_bytes`` (sparse collectives only, default 4) -- bytes per kept *value*: 4 for fp32,
  2 for fp16/bf16 gradients. Values then take ``M * c * value_bytes / 4`` bytes while the int32
  indices take ``M * c``; with the default both are ``M * c`` and the formulas are the paper's.

and return seconds. **Logarithms**: ``L = ceil(log2 N)`` (:func:`tree_rounds`), the rounds a
binomial tree or recursive doubling runs (as ``tree_allreduce`` and ``binomial_broadcast`` do); the
paper's real-valued ``log(N)`` would under-count a round that does run.

At ``N == 1`` every cost is exactly 0 (``N - 1 == 0`` and ``L == 0``): nothing is sent.

Selection among the sparse collectives (a top-k gradient of ``M * c`` value bytes):

* ``allgather`` -- every rank gathers every rank's values and int32 indices,
  ``alpha*L + 2*M*c*beta*(N-1)``;
* ``art_ring`` -- AR-Topk with a ring allreduce: broadcast the source rank's indices, then a ring
  allreduce of the values, Eq. 4a;
* ``art_tree`` -- AR-Topk with a tree allreduce, Eq. 4b.

Rules 5a-5c are the paper's closed forms of the pairwise comparisons; :func:`choose_sparse_collective`
compares the cost formulas directly. Both break ties the same way (see its docstring), and the test
suite checks that they agree over a grid.

How to tune: do not hand-tune ``alpha``/``beta`` from data-sheets; measure them in-band with
:func:`lightning_gc.comm.probe.probe_network` (it times a collective whose formula is known here and
inverts it), or pin them with :class:`NetworkModel` if the network is known and stable.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

__all__ = [
    "NetworkModel",
    "SparseCollective",
    "SPARSE_COLLECTIVE_TIE_ORDER",
    "log2n",
    "tree_rounds",
    "parameter_server_cost",
    "ring_allreduce_cost",
    "lowbit_ring_bytes",
    "lowbit_ring_cost",
    "tree_allreduce_cost",
    "broadcast_cost",
    "allgather_cost",
    "sparse_allgather_cost",
    "art_ring_cost",
    "art_tree_cost",
    "sparse_collective_costs",
    "rule_5a_coefficient",
    "rule_5b_coefficient",
    "rule_5c_coefficient",
    "rule_5a_ring_over_tree",
    "rule_5b_ring_over_allgather",
    "rule_5c_tree_over_allgather",
    "choose_sparse_collective",
    "choose_sparse_collective_by_rules",
    "NodeBytes",
    "exchange_bytes",
    "flat_card_bytes",
    "flat_direct_card_cost",
    "intra_stage_cost",
    "nodes_exchange_bytes",
    "nodes_exchange_cost",
    "shared_card_beta",
]

SparseCollective = Literal["allgather", "art_ring", "art_tree"]

#: Order in which equal-cost sparse collectives are preferred (first wins). It mirrors the strict
#: inequalities of rules 5a-5c: AR-Topk replaces allgather only when *strictly* cheaper (5b, 5c)
#: and ART-Ring replaces ART-Tree only when *strictly* cheaper (5a). Allgather first also means a
#: degenerate setting (``N == 1``, ``M*c == 0``, ``alpha == beta == 0``) picks the collective with
#: no source rank and no index broadcast.
SPARSE_COLLECTIVE_TIE_ORDER: tuple[SparseCollective, ...] = ("allgather", "art_tree", "art_ring")


# --------------------------------------------------------------------------------------------
# validation helpers
# --------------------------------------------------------------------------------------------
def _check_nonneg(name: str, value: float, fix: str) -> float:
    try:
        v = float(value)
    except (TypeError, ValueError):
        raise TypeError(f"{name}={value!r} is not a number; {fix}") from None
    if not math.isfinite(v) or v < 0:
        raise ValueError(f"{name}={value!r} must be a finite number >= 0; {fix}")
    return v


def _check_count(name: str, value: int, meaning: str, fix: str) -> int:
    try:
        v = operator.index(value)
    except TypeError:
        v = 0
    if isinstance(value, bool) or v < 1:
        raise ValueError(f"{name}={value!r} must be an integer >= 1 ({meaning}); {fix}")
    return v


def _check_n(N: int) -> int:
    return _check_count("N", N, "the number of ranks",
                        "pass the process-group size, e.g. torch.distributed.get_world_size(group)")


def _check_c(c: float) -> float:
    v = _check_nonneg("c", c, "pass the fraction of elements kept, e.g. 0.01 for top-1%")
    if v > 1:
        raise ValueError(
            f"c={c!r} must be at most 1: it is the fraction of elements kept, not a percentage; "
            "pass e.g. 0.01 for top-1%"
        )
    return v


def _check_common(alpha: float, beta: float, M: float, N: int) -> tuple[float, float, float, int]:
    a = _check_nonneg("alpha", alpha, "pass the latency per message in seconds, e.g. 1e-4")
    b = _check_nonneg("beta", beta, "pass seconds per byte, i.e. 8 / bandwidth_in_bits_per_second")
    m = _check_nonneg("M", M, "pass the dense fp32 message size in bytes (4 * numel)")
    return a, b, m, _check_n(N)


def log2n(N: int) -> float:
    """``log2(N)`` (real-valued). The formulas use :func:`tree_rounds` = ``ceil(log2 N)``."""
    return math.log2(_check_n(N))


def tree_rounds(N: int) -> int:
    """``L = ceil(log2 N)``: rounds of a binomial tree (reduce, broadcast) or of recursive
    doubling over ``N`` ranks; 0 at ``N == 1``. The only logarithm the formulas use."""
    return (_check_n(N) - 1).bit_length()


def _check_vb(value_bytes: float) -> float:
    v = _check_nonneg("value_bytes", value_bytes, "pass the bytes per kept value: 4 for fp32, 2 for fp16/bf16")
    if v == 0:
        raise ValueError(f"value_bytes={value_bytes!r} must be > 0: pass 4 for fp32, 2 for fp16/bf16")
    return v


# --------------------------------------------------------------------------------------------
# Bytes one rank sends (the byte accounting of collectives.py and direct.py)


def ring_allreduce_bytes(nbytes: int, world_size: int) -> int:
    """Bytes one rank sends in a ring allreduce of an ``nbytes`` message."""
    if world_size <= 1:
        return 0
    return int(round(2 * (world_size - 1) * nbytes / world_size))


def allgather_bytes(nbytes: int, world_size: int) -> int:
    """Bytes one rank sends in a ring allgather where every rank contributes ``nbytes``."""
    return (world_size - 1) * nbytes if world_size > 1 else 0


# --------------------------------------------------------------------------------------------
# Table I (dense collectives on M bytes)
# --------------------------------------------------------------------------------------------
def parameter_server_cost(alpha: float, beta: float, M: float, N: int) -> float:
    """Star / parameter server: ``2*alpha + 2*(N-1)*M*beta`` (Table I). 0 at ``N == 1``."""
    a, b, m, n = _check_common(alpha, beta, M, N)
    if n == 1:
        return 0.0
    return 2 * a + 2 * (n - 1) * m * b


def ring_allreduce_cost(alpha: float, beta: float, M: float, N: int) -> float:
    """Ring allreduce: ``2*(N-1)*alpha + 2*(N-1)/N*M*beta`` (Table I).

    ``N - 1`` reduce-scatter and ``N - 1`` allgather steps, each moving one ``M/N`` chunk.
    """
    a, b, m, n = _check_common(alpha, beta, M, N)
    return 2 * (n - 1) * a + 2 * (n - 1) / n * m * b


def lowbit_ring_bytes(numel: int, N: int, bits: int, block_size: int) -> float:
    """Bytes one rank sends in the ``lowbit`` ring (lightning_gc.exchanges.lowbit) of ``numel``
    elements: ``2(N−1)/N · (numel·bits/8 + 4·⌈numel/block_size⌉)``, codes plus one fp32 scale per
    block, flat in N (the exact count, chunks of whole blocks, is ``lowbit_bytes_sent``)."""
    n = _check_n(N)
    payload = numel * bits / 8 + 4 * -(-int(numel) // int(block_size))
    return 2 * (n - 1) / n * payload


def lowbit_ring_cost(alpha: float, beta: float, M: float, N: int) -> float:
    """The ``lowbit`` ring on a quantised message of ``M`` bytes (codes + scales): the ring
    allreduce's schedule, ``2(N−1)·alpha + 2(N−1)/N·M·beta``. It always runs on the P2P ring (its
    hops requantise), never on the backend's own allreduce; its codec work is not in this time."""
    return ring_allreduce_cost(alpha, beta, M, N)


def direct_cost(alpha: float, beta: float, M: float, N: int) -> float:
    """Direct exchange (:mod:`lightning_gc.comm.direct`): ``alpha + (N-1)*M*beta``. Every rank sends
    its ``M`` bytes to the ``N - 1`` others at once: one message latency, ``N - 1`` messages' bytes on
    its link. The allreduce then sums locally; the allgather keeps what arrived. 0 at ``N == 1``."""
    a, b, m, n = _check_common(alpha, beta, M, N)
    if n == 1:
        return 0.0
    return a + (n - 1) * m * b


def tree_allreduce_cost(alpha: float, beta: float, M: float, N: int) -> float:
    """Tree allreduce (binomial reduce then broadcast): ``2*alpha*L + 2*L*M*beta`` (Table I),
    ``L = ceil(log2 N)``: each phase is ``L`` rounds of one full ``M``-byte message."""
    a, b, m, n = _check_common(alpha, beta, M, N)
    lg = tree_rounds(n)
    return 2 * a * lg + 2 * lg * m * b


def broadcast_cost(alpha: float, beta: float, M: float, N: int) -> float:
    """Binomial-tree broadcast: ``alpha*L + L*M*beta`` (Table I), ``L = ceil(log2 N)`` rounds."""
    a, b, m, n = _check_common(alpha, beta, M, N)
    lg = tree_rounds(n)
    return a * lg + lg * m * b


def allgather_cost(alpha: float, beta: float, M: float, N: int) -> float:
    """Allgather of ``M`` bytes per rank: ``alpha*L + (N-1)*M*beta`` (Table I), ``L = ceil(log2 N)``."""
    a, b, m, n = _check_common(alpha, beta, M, N)
    return a * tree_rounds(n) + (n - 1) * m * b


# --------------------------------------------------------------------------------------------
# sparse collectives (Section 3-D)
# --------------------------------------------------------------------------------------------
def _sparse_bytes(M: float, c: float, value_bytes: float) -> tuple[float, float]:
    """(index bytes, value bytes) of a top-k message: ``M*c`` and ``M*c*value_bytes/4``."""
    idx = M * c
    return idx, idx * value_bytes / 4


def sparse_allgather_cost(alpha: float, beta: float, M: float, N: int, c: float, value_bytes: float = 4) -> float:
    """Allgather of top-k values + int32 indices: ``alpha*L + (I + V)*beta*(N-1)``.

    ``I = M*c`` index bytes, ``V = M*c*value_bytes/4`` value bytes; with fp32 values
    (``value_bytes = 4``) this is the paper's ``alpha*L + 2*M*c*beta*(N-1)``.
    """
    a, b, m, n = _check_common(alpha, beta, M, N)
    idx, val = _sparse_bytes(m, _check_c(c), _check_vb(value_bytes))
    return a * tree_rounds(n) + (idx + val) * b * (n - 1)


def art_ring_cost(alpha: float, beta: float, M: float, N: int, c: float, value_bytes: float = 4) -> float:
    """AR-Topk with ring allreduce, Eq. 4a: binomial broadcast of the ``I`` index bytes + ring
    allreduce of the ``V`` value bytes,
    ``alpha*[2(N-1) + L] + beta*[I*L + V*2(N-1)/N]``; with fp32 values
    ``alpha*[2(N-1) + L] + M*c*beta*[2(N-1)/N + L]``.
    """
    a, b, m, n = _check_common(alpha, beta, M, N)
    idx, val = _sparse_bytes(m, _check_c(c), _check_vb(value_bytes))
    lg = tree_rounds(n)
    return a * (2 * (n - 1) + lg) + b * (idx * lg + val * 2 * (n - 1) / n)


def art_tree_cost(alpha: float, beta: float, M: float, N: int, c: float, value_bytes: float = 4) -> float:
    """AR-Topk with tree allreduce, Eq. 4b: binomial broadcast of ``I`` index bytes + binomial tree
    allreduce of ``V`` value bytes, ``3*alpha*L + beta*L*(I + 2*V)``; with fp32 values
    ``3*alpha*L + 3*M*c*beta*L``.
    """
    a, b, m, n = _check_common(alpha, beta, M, N)
    idx, val = _sparse_bytes(m, _check_c(c), _check_vb(value_bytes))
    lg = tree_rounds(n)
    return 3 * a * lg + b * lg * (idx + 2 * val)


def sparse_collective_costs(
    alpha: float, beta: float, M: float, N: int, c: float, value_bytes: float = 4
) -> dict[SparseCollective, float]:
    """Predicted seconds of the three sparse collectives, keyed by name (``M = 4 * numel``)."""
    return {
        "allgather": sparse_allgather_cost(alpha, beta, M, N, c, value_bytes),
        "art_ring": art_ring_cost(alpha, beta, M, N, c, value_bytes),
        "art_tree": art_tree_cost(alpha, beta, M, N, c, value_bytes),
    }


# --------------------------------------------------------------------------------------------
# rules 5a-5c (closed forms)
# --------------------------------------------------------------------------------------------
def rule_5a_coefficient(N: int) -> float:
    """``K`` of rule 5a: ART-Ring beats ART-Tree iff ``alpha/beta < K * M * c``.

    ``K = (L - (N-1)/N) / (N - 1 - L)`` with ``L = ceil(log2 N)``. The denominator vanishes at
    ``N == 2`` and ``N == 3`` (``L == N - 1``) while the numerator is positive: the alpha terms of
    Eq. 4a and 4b are then equal and the ring wins for *every* ``alpha`` as soon as
    ``M*c*beta > 0``, so ``K = inf``. At ``N == 1`` both numerator and denominator are 0 and
    nothing is sent: ``K = nan`` (the rule never fires). For ``N >= 4`` the denominator is
    positive and ``K`` is finite and positive.
    """
    n = _check_n(N)
    if n == 1:
        return math.nan
    lg = tree_rounds(n)
    if n - 1 - lg == 0:
        return math.inf
    return (lg - (n - 1) / n) / (n - 1 - lg)


def rule_5b_coefficient(N: int) -> float:
    """``K`` of rule 5b: ART-Ring beats allgather iff ``alpha/beta < K * M * c``.

    ``K = 1 - 1/N - L / (2(N-1))``, ``L = ceil(log2 N)``. ``K == 0`` at ``N == 2`` (the ring can
    at best tie allgather, when ``alpha == 0``); ``nan`` at ``N == 1`` (rule never fires).
    """
    n = _check_n(N)
    if n == 1:
        return math.nan
    return 1 - 1 / n - tree_rounds(n) / (2 * (n - 1))


def rule_5c_coefficient(N: int) -> float:
    """``K`` of rule 5c: ART-Tree beats allgather iff ``alpha/beta < K * M * c``.

    ``K = (N-1)/L - 3/2``, ``L = ceil(log2 N)``: negative at ``N`` = 2, 3 and 5, zero at
    ``N == 4``, positive from 6 on -- so with ``alpha >= 0`` ART-Tree never beats allgather below
    6 ranks. ``nan`` at ``N == 1``.
    """
    n = _check_n(N)
    if n == 1:
        return math.nan
    return (n - 1) / tree_rounds(n) - 1.5


def _rule(alpha: float, beta: float, M: float, N: int, c: float, coeff: Callable[[int], float]) -> bool:
    # Written as alpha < K*M*c*beta (multiplied out) so that beta == 0 needs no division.
    a, b, m, n = _check_common(alpha, beta, M, N)
    cc = _check_c(c)
    if n == 1:  # nothing is sent: no collective is strictly cheaper than another
        return False
    k = coeff(n)
    if math.isinf(k):  # rule 5a at N == 2: the alpha terms cancel, any M*c*beta > 0 decides
        return m * cc * b > 0
    return a < k * m * cc * b


def rule_5a_ring_over_tree(alpha: float, beta: float, M: float, N: int, c: float) -> bool:
    """Rule 5a: True iff ART-Ring is strictly cheaper than ART-Tree,
    ``alpha/beta < (L - (N-1)/N)/(N-1-L) * M*c`` (``N`` = 2, 3: see :func:`rule_5a_coefficient`)."""
    return _rule(alpha, beta, M, N, c, rule_5a_coefficient)


def rule_5b_ring_over_allgather(alpha: float, beta: float, M: float, N: int, c: float) -> bool:
    """Rule 5b: True iff ART-Ring is strictly cheaper than allgather,
    ``alpha/beta < (1 - 1/N - L/(2(N-1))) * M*c``."""
    return _rule(alpha, beta, M, N, c, rule_5b_coefficient)


def rule_5c_tree_over_allgather(alpha: float, beta: float, M: float, N: int, c: float) -> bool:
    """Rule 5c: True iff ART-Tree is strictly cheaper than allgather,
    ``alpha/beta < ((N-1)/L - 3/2) * M*c``."""
    return _rule(alpha, beta, M, N, c, rule_5c_coefficient)


def choose_sparse_collective_by_rules(
    alpha: float, beta: float, M: float, N: int, c: float
) -> SparseCollective:
    """The paper's decision procedure from the closed forms only (fp32 values: the closed forms
    assume values and indices of the same width; :func:`choose_sparse_collective` takes
    ``value_bytes``).

    Rule 5a picks the AR-Topk flavour; rule 5b (ring) or 5c (tree) then decides whether it beats
    allgather. Agrees with :func:`choose_sparse_collective` (same tie order) up to floating-point
    rounding at the exact decision boundaries.
    """
    if rule_5a_ring_over_tree(alpha, beta, M, N, c):
        return "art_ring" if rule_5b_ring_over_allgather(alpha, beta, M, N, c) else "allgather"
    return "art_tree" if rule_5c_tree_over_allgather(alpha, beta, M, N, c) else "allgather"


def choose_sparse_collective(
    alpha: float, beta: float, M: float, N: int, c: float, value_bytes: float = 4
) -> SparseCollective:
    """Pick the cheapest of allgather / ART-Ring / ART-Tree by comparing the cost formulas.

    Ties (degenerate settings, or exactly on a rule boundary) are broken by
    :data:`SPARSE_COLLECTIVE_TIE_ORDER`. The inputs must be replicated across ranks (e.g. a probed,
    agreed :class:`NetworkModel`), otherwise ranks pick different collectives and hang.
    """
    costs = sparse_collective_costs(alpha, beta, M, N, c, value_bytes)
    best = SPARSE_COLLECTIVE_TIE_ORDER[0]
    for name in SPARSE_COLLECTIVE_TIE_ORDER[1:]:
        if costs[name] < costs[best]:
            best = name
    return best


# --------------------------------------------------------------------------------------------
# NetworkModel
# --------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class NetworkModel:
    """Latency and inverse bandwidth of the network between the ranks of one process group.

    Args:
        alpha_s: seconds per message (``>= 0``). On real networks tens of microseconds (same rack)
            to milliseconds (WAN); on loopback/veth it is the software stack's latency only.
        beta_s_per_byte: seconds per byte (``>= 0``), i.e. ``8 / bandwidth_bits_per_s``:
            ``8e-10`` for 10 Gbit/s.

    ``beta == 0`` (infinite bandwidth) is allowed: it is what a probe returns when its message
    sizes were too small to see bandwidth (see the clamping rule there); every formula stays defined.

    Use :meth:`from_bandwidth` to pin a known network, or
    :func:`lightning_gc.comm.probe.probe_network` to measure one.
    """

    alpha_s: float
    beta_s_per_byte: float

    def __post_init__(self) -> None:
        _check_nonneg("alpha_s", self.alpha_s, "pass the latency per message in seconds, e.g. 1e-4")
        _check_nonneg(
            "beta_s_per_byte",
            self.beta_s_per_byte,
            "pass seconds per byte, i.e. 8 / bandwidth_in_bits_per_second (use NetworkModel.from_bandwidth)",
        )
        object.__setattr__(self, "alpha_s", float(self.alpha_s))
        object.__setattr__(self, "beta_s_per_byte", float(self.beta_s_per_byte))

    @classmethod
    def from_bandwidth(cls, bits_per_s: float, latency_s: float) -> NetworkModel:
        """Build from a bandwidth in bits per second (e.g. ``10e9``) and a latency in seconds."""
        bw = _check_nonneg("bits_per_s", bits_per_s, "pass e.g. 10e9 for 10 Gbit/s")
        if bw == 0:
            raise ValueError(
                f"bits_per_s={bits_per_s!r} must be > 0: a zero bandwidth has no finite beta; "
                "pass the link bandwidth, e.g. 10e9 for 10 Gbit/s"
            )
        return cls(alpha_s=latency_s, beta_s_per_byte=8.0 / bw)

    @property
    def bandwidth_bits_per_s(self) -> float:
        """``8 / beta`` (``inf`` when ``beta == 0``)."""
        return math.inf if self.beta_s_per_byte == 0 else 8.0 / self.beta_s_per_byte

    def ring_allreduce(self, M: float, N: int) -> float:
        return ring_allreduce_cost(self.alpha_s, self.beta_s_per_byte, M, N)

    def tree_allreduce(self, M: float, N: int) -> float:
        return tree_allreduce_cost(self.alpha_s, self.beta_s_per_byte, M, N)

    def broadcast(self, M: float, N: int) -> float:
        return broadcast_cost(self.alpha_s, self.beta_s_per_byte, M, N)

    def allgather(self, M: float, N: int) -> float:
        return allgather_cost(self.alpha_s, self.beta_s_per_byte, M, N)

    def sparse_costs(self, M: float, N: int, c: float, value_bytes: float = 4) -> dict[SparseCollective, float]:
        """Sparse costs with ``M = 4 * numel`` and ``value_bytes`` per kept value."""
        return sparse_collective_costs(self.alpha_s, self.beta_s_per_byte, M, N, c, value_bytes)

    def choose_sparse_collective(self, M: float, N: int, c: float, value_bytes: float = 4) -> SparseCollective:
        return choose_sparse_collective(self.alpha_s, self.beta_s_per_byte, M, N, c, value_bytes)


# --------------------------------------------------------------------------------------------
# topology: hosts of k ranks (lightning_gc/comm/hierarchy.py, docs/topology.md "Byte model")
# --------------------------------------------------------------------------------------------
#: how an exchange's payload travels: a ring allreduce, an allgather, or lowbit's k-bit ring
#: (an allreduce's schedule); ``direct`` (comm/direct.py) changes the allreduce's bytes and every latency
ExchangeWire = Literal["allreduce", "allgather", "lowbit"]


def _check_wire(wire: str) -> str:
    if wire not in ("allreduce", "allgather", "lowbit"):
        raise ValueError(f"wire={wire!r} is not an exchange a topology can run: use 'allreduce', 'allgather' or "
                         "'lowbit' (the collectives topology='nodes' runs between nodes)")
    return wire


def _check_k(k: int) -> int:
    return _check_count("k", k, "ranks per node", "pass e.g. 8 for 8 GPUs a node")


def exchange_bytes(wire: str, payload: float, n: int, direct: bool = False) -> float:
    """Bytes one rank sends in an exchange of ``payload`` bytes per rank on ``n`` ranks: a ring
    allreduce (``allreduce``, ``lowbit``) ``2(n−1)/n · payload``; an allgather, or the direct exchange
    of either (every rank sends its message to the n − 1 others), ``(n−1) · payload``."""
    _check_wire(wire)
    n = _check_n(n)
    p = _check_nonneg("payload", payload, "pass the bytes one rank contributes")
    if wire == "allgather" or direct:
        return (n - 1) * p
    return 2 * (n - 1) / n * p


def flat_card_bytes(wire: str, payload: float, N: int, k: int, direct: bool = False) -> float:
    """Bytes a host's network card sends per exchange, flat on ``N`` ranks with ``k`` per host (ranks
    numbered host by host, as launchers number them).

    A ring (allreduce, ring allgather, lowbit) crosses each card once per direction: only the rank
    whose ring neighbour is on the next host sends over the card, ``exchange_bytes(...)`` of it. The
    direct exchange sends from each of the host's ``k`` ranks to the ``N − k`` ranks of the other
    hosts: ``k · (N − k) · payload``. ``k == N`` (one host): 0."""
    n, kk = _check_n(N), _check_k(k)
    if n % kk:
        raise ValueError(f"N={N!r} ranks with k={k!r} per host: N must be a multiple of k")
    if kk == n:
        return 0.0
    if direct:
        return float(kk * (n - kk) * _check_nonneg("payload", payload, "pass the bytes one rank contributes"))
    return exchange_bytes(wire, payload, n)


def flat_direct_card_cost(alpha: float, beta: float, payload: float, N: int, k: int) -> float:
    """The direct exchange (comm/direct.py) flat on ``N`` ranks, ``k`` per host sharing the card
    (``beta``: the card's seconds per byte): one latency, then the card's
    ``k · (N − k) · payload`` bytes, :func:`flat_card_bytes`. At ``k == 1`` it is :func:`direct_cost`."""
    a, b, p, n = _check_common(alpha, beta, payload, N)
    if n == 1:
        return 0.0
    return a + flat_card_bytes("allgather", p, n, k, direct=True) * b


def shared_card_beta(beta: float, k: int) -> float:
    """Seconds per byte one rank sees between nodes when the ``k`` ranks of its node send at once
    through the node's card (rate ``8 / beta``): each gets ``1/k`` of it, ``k · beta``. This is the
    ``k`` that a model of one flat link misses for every exchange ``topology="nodes"`` runs between
    nodes: all ``k`` shard groups cross the same card at the same time."""
    return _check_k(k) * _check_nonneg("beta", beta, "pass seconds per byte, i.e. 8 / bandwidth_in_bits_per_second")


def intra_stage_cost(alpha: float, beta: float, M: float, k: int) -> float:
    """One intra-node stage of ``topology="nodes"``, a ring reduce-scatter (or allgather) of ``M``
    bytes on the node's ``k`` ranks: ``(k−1)·alpha + (k−1)/k · M · beta``, half a ring allreduce."""
    a, b, m, _ = _check_common(alpha, beta, M, 1)
    kk = _check_k(k)
    return (kk - 1) * a + (kk - 1) / kk * m * b


@dataclass(frozen=True)
class NodeBytes:
    """Bytes of one exchange by nodes: ``intra`` and ``inter`` one rank sends inside its node and
    between nodes, ``card`` what its node's network card sends between nodes (``k · inter``)."""

    intra: float
    inter: float
    card: float


def _nodes_sizes(M: float, nodes: int, k: int, payload: float | None,
                 intra_M: float | None) -> tuple[float, int, int, float, float]:
    """(M, nodes, k, the shard's payload, the reduce-scatter's bytes), validated, with their defaults."""
    m = _check_nonneg("M", M, "pass the group's bytes (4 * numel for fp32)")
    kk, nn = _check_k(k), _check_n(nodes)
    p = m / kk if payload is None else _check_nonneg("payload", payload, "pass the shard's message bytes")
    scatter = m if intra_M is None else _check_nonneg("intra_M", intra_M, "pass the reduce-scatter's bytes")
    return m, nn, kk, p, scatter


def nodes_exchange_bytes(M: float, nodes: int, k: int, wire: str = "allreduce", payload: float | None = None,
                         direct: bool = False, intra_M: float | None = None) -> NodeBytes:
    """Bytes of one group of ``M`` bytes by nodes (docs/topology.md, "Byte model"):

    * inside the node, the reduce-scatter of ``intra_M`` (default ``M``; half of it for a bf16
      reduce-scatter of fp32) and the allgather of the shards' means (``M``): ``(k−1)/k`` each;
    * between nodes, the exchange of this rank's shard: ``payload`` bytes (default ``M/k``, the dense
      shard) on ``nodes`` ranks, :func:`exchange_bytes`;
    * the card carries ``k`` times that (each local rank sends its own shard)."""
    m, nn, kk, p, scatter = _nodes_sizes(M, nodes, k, payload, intra_M)
    inter = exchange_bytes(wire, p, nn, direct)
    return NodeBytes((kk - 1) / kk * (scatter + m), inter, kk * inter)


def nodes_exchange_cost(alpha_intra: float, beta_intra: float, alpha_inter: float, beta_inter: float, M: float,
                        nodes: int, k: int, wire: str = "allreduce", payload: float | None = None,
                        direct: bool = False, intra_M: float | None = None) -> float:
    """Seconds of one group's exchange by nodes (``topology="nodes"``, comm/hierarchy.py):

    ``intra_stage_cost(intra_M) + inter + intra_stage_cost(M)`` where ``inter`` is the exchange of
    this rank's shard (``payload`` bytes, default the dense shard ``M/k``) on ``nodes`` ranks at
    :func:`shared_card_beta` (the ``k`` local ranks share the card): a ring allreduce
    (:func:`ring_allreduce_cost`; ``lowbit``: :func:`lowbit_ring_cost`) or an allgather
    (:func:`allgather_cost`), or with ``direct`` the direct exchange of either
    (:func:`direct_cost`). ``beta_*`` are the links' seconds per byte (``8 / bits per second``):
    the inter-node one is the card's whole rate, not a rank's share. The stages run one after the
    other (each needs the one before)."""
    _check_wire(wire)
    m, nn, kk, p, scatter = _nodes_sizes(M, nodes, k, payload, intra_M)
    b = shared_card_beta(beta_inter, kk)
    if direct:
        inter = direct_cost(alpha_inter, b, p, nn)
    elif wire == "allgather":
        inter = allgather_cost(alpha_inter, b, p, nn)
    else:  # allreduce and lowbit's ring share the ring allreduce's schedule
        inter = ring_allreduce_cost(alpha_inter, b, p, nn)
    return (intra_stage_cost(alpha_intra, beta_intra, scatter, kk) + inter
            + intra_stage_cost(alpha_intra, beta_intra, m, kk))
