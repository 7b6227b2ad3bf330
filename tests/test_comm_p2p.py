"""P2P ring and tree allreduce against native ``dist.all_reduce`` on gloo ranks.

One 5-rank spawn covers groups of 2, 3, 4 and 5 ranks (spawning is the expensive part); each
worker runs every case and returns a list of mismatch descriptions plus result digests, and the
parent asserts, so a failing case never leaves the other ranks hanging in a later collective.
"""

from __future__ import annotations

import hashlib
import math

import pytest
import torch
import torch.distributed as dist
from dist_harness import run_distributed

from lightning_gc.comm.p2p_allreduce import (
    binomial_broadcast,
    ring_allreduce,
    ring_bytes_sent,
    tree_allreduce,
    tree_bytes_sent,
)

ALGOS = {"ring": ring_allreduce, "tree": tree_allreduce}


# ------------------------------------------------------------------------------------------
# independent oracles (not using the library's helpers)
# ------------------------------------------------------------------------------------------
def _oracle_ring_bytes(numel: int, esize: int, n: int, r: int) -> int:
    # torch.tensor_split puts the extra elements in the first chunks, like the ring does. In the
    # reduce-scatter a rank sends every chunk except (r+1)%n (the one it ends up owning); in the
    # allgather every chunk except (r+2)%n (the one its right neighbour owns).
    if n == 1:
        return 0
    sizes = [len(c) for c in torch.tensor_split(torch.arange(numel), n)]
    return (2 * sum(sizes) - sizes[(r + 1) % n] - sizes[(r + 2) % n]) * esize


# The binomial tree rooted at 0, stated independently: the parent of d is d with its lowest set
# bit cleared (bit tricks written out with a loop, not the library's helpers).
def _oracle_parent(d: int) -> int:
    bit = 1
    while not d & bit:
        bit <<= 1
    return d - bit


def _oracle_children(r: int, n: int) -> list[int]:
    return sorted(d for d in range(1, n) if _oracle_parent(d) == r)


def _oracle_tree_bytes(numel: int, esize: int, n: int, r: int) -> int:
    return ((r != 0) + len(_oracle_children(r, n))) * numel * esize if n > 1 else 0


def _oracle_subtree(c: int, n: int) -> int:
    # ranks whose chain of parents passes through c
    count = 0
    for d in range(n):
        x = d
        while x > c:
            x = _oracle_parent(x)
        count += x == c
    return count


def _input(kind: str, numel: int, rank: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 + 7 * rank + numel)
    if kind == "int64":  # large values: sums wrap around, which must match too
        return torch.randint(-(2**62), 2**62, (numel,), generator=g, dtype=torch.int64)
    return torch.randn(numel, generator=g, dtype=torch.float32) * (rank + 1)


def _digest(t: torch.Tensor) -> str:
    return hashlib.sha1(t.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()


# ------------------------------------------------------------------------------------------
# worker
# ------------------------------------------------------------------------------------------
def _check_group(errors: list, digests: dict, tag: str, group, cases: list[tuple[str, int]]) -> None:
    n = dist.get_world_size(group)
    r = dist.get_rank(group)
    for algo, fn in ALGOS.items():
        for kind, numel in cases:
            case = f"{tag} {algo} {kind} numel={numel}"
            x = _input(kind, numel, dist.get_rank())
            ref = x.clone()
            dist.all_reduce(ref, group=group)
            stats = fn(x, group)
            if kind == "int64":
                if not torch.equal(x, ref):
                    errors.append(f"{case}: not bit-identical to dist.all_reduce")
            elif not torch.allclose(x, ref, rtol=1e-5, atol=1e-5):
                errors.append(f"{case}: max err {(x - ref).abs().max().item()}")
            esize = x.element_size()
            expected = (_oracle_ring_bytes if algo == "ring" else _oracle_tree_bytes)(numel, esize, n, r)
            if stats.bytes_sent != expected:
                errors.append(f"{case}: bytes_sent {stats.bytes_sent} != analytic {expected}")
            helper = (ring_bytes_sent if algo == "ring" else tree_bytes_sent)(numel, esize, n, r)
            if helper != expected:
                errors.append(f"{case}: bytes helper {helper} != analytic {expected}")
            digests[case] = (_digest(x), stats.bytes_sent, stats.bytes_received)


def _hop_check(errors: list, tag: str, group, numel: int) -> None:
    """All-ones data: the incoming chunk at hop m must hold exactly m everywhere."""
    n = dist.get_world_size(group)
    r = dist.get_rank(group)
    for algo, fn in ALGOS.items():
        calls: list[int] = []

        def counting(acc: torch.Tensor, inc: torch.Tensor, hop: int, calls: list = calls, algo: str = algo) -> None:
            calls.append(hop)
            if inc.numel() and not torch.all(inc == hop):
                errors.append(f"{tag} {algo}: incoming chunk at hop {hop} holds {inc.unique().tolist()}")
            acc.add_(inc)

        x = torch.ones(numel, dtype=torch.int64)
        stats = fn(x, group, counting)
        if not torch.all(x == n):
            errors.append(f"{tag} {algo}: all-ones sum is {x.unique().tolist()}, want {n}")
        if algo == "ring":
            want = list(range(1, n))
        else:
            # children in round order (rank+1, rank+2, rank+4, ...), hop = the child's subtree size
            want = [_oracle_subtree(c, n) for c in _oracle_children(r, n)]
            # one full message per round: the root receives one message in each of the
            # ceil(log2 N) rounds (the L of the cost model), every other rank at most one per round
            nb = numel * x.element_size()
            if stats.messages_sent != (r != 0) + len(_oracle_children(r, n)):
                errors.append(f"{tag} tree: rank {r} sent {stats.messages_sent} messages")
            if r == 0 and stats.bytes_received != math.ceil(math.log2(n)) * nb:
                errors.append(f"{tag} tree: root received {stats.bytes_received} B, want ceil(log2 N) messages")
        if calls != want:
            errors.append(f"{tag} {algo} numel={numel}: combine hops {calls}, want {want}")
        if stats.combine_calls != len(want):
            errors.append(f"{tag} {algo}: combine_calls {stats.combine_calls} != {len(want)}")


def _custom_combine_check(errors: list, group) -> None:
    """A max-combine (in place for the tree, returning a new tensor for the ring) must equal
    all_reduce(MAX)."""
    variants = {
        "tree": ("inplace", lambda a, b, h: torch.maximum(a, b, out=a)),
        "ring": ("returned", lambda a, b, h: torch.maximum(a, b)),
    }
    for algo, fn in ALGOS.items():
        name, comb = variants[algo]
        x = _input("float32", 37, dist.get_rank())
        ref = x.clone()
        dist.all_reduce(ref, op=dist.ReduceOp.MAX, group=group)
        fn(x, group, comb)
        if not torch.equal(x, ref):
            errors.append(f"{algo} max-combine ({name}) differs from all_reduce(MAX)")


# Group sizes 2..4 are subgroups of one 5-rank world whose group ranks differ from the global
# ranks (exercising the rank translation); 5 is the world group itself (group=None). One spawn
# instead of four keeps the suite fast on small machines.
SUBGROUPS = {2: [1, 3], 3: [0, 2, 4], 4: [1, 2, 3, 4]}
WORLD = 5


def _broadcast_check(errors: list, n: int, group) -> None:
    """binomial_broadcast equals dist.broadcast from every source; the source sends ceil(log2 N) copies."""
    rank = dist.get_rank(group)
    for src in range(n):
        mine = torch.arange(7, dtype=torch.int64) * (rank + 1) + 1000 * src
        ref = mine.clone()
        glob_src = dist.get_global_rank(group, src) if group is not None else src
        dist.broadcast(ref, glob_src, group=group)
        got = mine.clone()
        sent = binomial_broadcast(got, src, group)
        if not torch.equal(got, ref):
            errors.append(f"N={n} src={src}: binomial_broadcast differs from dist.broadcast")
        if rank == src and sent != math.ceil(math.log2(n)) * got.numel() * 8:
            errors.append(f"N={n} src={src}: source sent {sent} bytes, expected ceil(log2 N) copies")


def _worker(rank: int, world_size: int) -> dict:
    errors: list[str] = []
    digests: dict = {}
    groups = {n: dist.new_group(members) for n, members in SUBGROUPS.items()}  # all ranks call
    groups[WORLD] = None
    for n, group in groups.items():
        if group is not None and rank not in SUBGROUPS[n]:
            continue
        # int64 (exact) over sizes below, at and above N and not divisible by N; float32 on two
        int_sizes = sorted({0, 1, max(1, n - 1), n + 1, 5 * n + 3})
        cases = [("int64", s) for s in int_sizes] + [("float32", n + 1), ("float32", 1031)]
        _check_group(errors, digests, f"N={n}", group, cases)
        for numel in (1, 4 * n + 1):
            _hop_check(errors, f"N={n}", group, numel)
        _custom_combine_check(errors, group)
        _broadcast_check(errors, n, group)

    # 2-D contiguous input is reduced element-wise through its flat view
    x2 = _input("float32", 15, rank).view(3, 5)
    ref2 = x2.clone()
    dist.all_reduce(ref2)
    ring_allreduce(x2)
    if x2.shape != (3, 5) or not torch.allclose(x2, ref2, rtol=1e-5, atol=1e-5):
        errors.append("2-D tensor: result differs from all_reduce")

    # a single-rank group: no-op; a non-member: clear error; non-contiguous: clear error
    solo = dist.new_group([1])
    if rank == 1:
        y = torch.arange(5.0)
        for fn in ALGOS.values():
            st = fn(y, solo, lambda a, b, h: errors.append("combine called at world size 1"))
            if st.bytes_sent or st.messages_sent or not torch.equal(y, torch.arange(5.0)):
                errors.append(f"world size 1 is not a no-op: {st}")
    else:
        with pytest.raises(ValueError, match="not a member"):
            ring_allreduce(torch.zeros(3), solo)
    with pytest.raises(ValueError, match="not contiguous"):
        ring_allreduce(torch.zeros(4, 4).t())
    if rank in SUBGROUPS[2]:
        # both members raise at the same point (after the first ring exchange completed), so no
        # message is left in flight
        with pytest.raises(TypeError, match="same shape"):
            ring_allreduce(torch.zeros(4), groups[2], lambda a, b, h: torch.zeros(3))
    dist.barrier()
    return {"errors": errors, "digests": digests}


def test_ring_and_tree_match_native_allreduce_for_2_to_5_ranks() -> None:
    results = run_distributed(_worker, WORLD)
    errors = [f"rank {r}: {e}" for r, res in enumerate(results) for e in res["errors"]]
    assert not errors, "\n".join(errors)
    # every member holds the bit-identical result; bytes sent == bytes received over the group
    cases = set().union(*(res["digests"] for res in results))
    for case in cases:
        holders = [res["digests"][case] for res in results if case in res["digests"]]
        n = int(case.split()[0].removeprefix("N="))
        assert len(holders) == n, case
        assert len({h[0] for h in holders}) == 1, f"{case}: results differ across ranks"
        assert sum(h[1] for h in holders) == sum(h[2] for h in holders), case
    for n in (2, 3, 4, 5):
        for algo in ALGOS:
            assert any(c.startswith(f"N={n} {algo} ") for c in cases), (n, algo)


def test_ring_bytes_approach_model() -> None:
    # 2(N-1)/N * M per rank when numel divides evenly (Table I's Ring-AR bandwidth term)
    for n in (2, 3, 4, 8):
        numel = 24 * n
        for r in range(n):
            assert ring_bytes_sent(numel, 4, n, r) == 2 * (n - 1) * (numel // n) * 4
    # binomial tree over 5 ranks: 0 -> {1, 2, 4}, 2 -> {3}; leaves send once, inner nodes
    # 1 + children, the root only to its ceil(log2 5) = 3 children
    assert [tree_bytes_sent(10, 4, 5, r) for r in range(5)] == [120, 40, 80, 40, 40]


# ------------------------------------------------------------------------------------------
# host staging: CUDA tensors over gloo travel through host memory (lightning_gc/comm/p2p.py)
# ------------------------------------------------------------------------------------------
# written out by hand from what each exchange does (not a list of the library's): the collectives
# whose payloads travel by our isend/irecv rings and trees
_HAND_P2P = {"ring", "tree", "art_ring", "art_tree", "auto_sparse", "marsit", "marsit_cascade", "gradiveq_ring"}
STAGE_WORLD = 3


def _force_staging(only_group=None) -> dict:
    """Make ``p2p.staged`` answer True (for every group, or only ``only_group``): CPU tensors then take
    the host-staged path CUDA tensors take on gloo. Returns counters of the staged sends and receives."""
    from lightning_gc.comm import p2p

    counts: dict = {"sends": 0}
    real_staged, real_host_send = p2p.staged, p2p._host_send

    def staged(tensor, group):
        hit = only_group is None or group is only_group
        return hit or real_staged(tensor, group)

    def host_send(tensor):
        counts["sends"] += 1
        out = real_host_send(tensor)
        assert out.data_ptr() != tensor.data_ptr(), "the staged send must be a copy"
        return out

    p2p.staged, p2p._host_send = staged, host_send
    counts["restore"] = lambda: setattr(p2p, "staged", real_staged) or setattr(p2p, "_host_send", real_host_send)
    return counts


def _staged_primitives(rank: int, ws: int) -> list[str]:
    """Ring, tree and binomial broadcast with every message staged equal the backend's own
    collectives (int64: exact), and a staged send is a copy, so the caller's tensor is never sent."""
    errors: list[str] = []
    counts = _force_staging()
    try:
        for algo, fn in ALGOS.items():
            for numel in (1, ws + 1, 5 * ws + 3):
                x = _input("int64", numel, rank)
                ref = x.clone()
                dist.all_reduce(ref)
                before = counts["sends"]
                stats = fn(x, None)
                if not torch.equal(x, ref):
                    errors.append(f"staged {algo} numel={numel}: differs from dist.all_reduce")
                if counts["sends"] - before != stats.messages_sent:
                    errors.append(f"staged {algo} numel={numel}: {counts['sends'] - before} staged sends, "
                                  f"{stats.messages_sent} messages")
        for src in range(ws):
            mine = torch.arange(9, dtype=torch.int64) * (rank + 1) + 100 * src
            ref = mine.clone()
            dist.broadcast(ref, src)
            binomial_broadcast(mine, src, None)
            if not torch.equal(mine, ref):
                errors.append(f"staged broadcast src={src}: differs from dist.broadcast")
    finally:
        counts["restore"]()
    return errors


def _staged_pairs(rank: int, ws: int) -> dict:
    """Every compressor over every point-to-point collective, in the engine: a replica whose
    exchanges all go through host memory (its own process group staged) against one that sends
    directly, on this rank's data; gradients bit for bit at every step."""
    from test_engine_overlap import PAIRS, _engine, _model, train_replicas
    from torch.nn.parallel import DistributedDataParallel as DDP

    from lightning_gc.engine import gc_comm_hook

    out = {}
    for name, coll in [(n, c) for n, c in PAIRS if c in _HAND_P2P]:
        models = [_model(), _model()]
        ddps = [DDP(m, bucket_cap_mb=0.002) for m in models]
        # auto_sparse on a bandwidth-bound model, so that it picks ART-Ring (point to point)
        network = (1e-6, 1e-6) if coll == "auto_sparse" else (1e-4, 8e-8)
        engines = [_engine(m, name, coll, overlap, network=network) for m, overlap in zip(models, (True, False))]
        counts = _force_staging(only_group=engines[0].exchange_group)
        try:
            for d, e in zip(ddps, engines):
                d.register_comm_hook(e, gc_comm_hook)
            mismatch, diverged = train_replicas(rank, ws, name, models, ddps, engines)
        finally:
            counts["restore"]()
        totals = [e.totals() for e in engines]
        out[f"{name}/{coll}"] = {"mismatch": mismatch[:3], "diverged": diverged[:3], "staged_sends": counts["sends"],
                                 "compressed": [t["compressed_steps"] for t in totals],
                                 "bytes": [t["bytes_sent"] for t in totals]}
        for e in engines:
            e.close()
    return out


def test_staged_point_to_point_equals_the_backends_collectives() -> None:
    results = run_distributed(_staged_primitives, STAGE_WORLD)
    errors = [f"rank {r}: {e}" for r, errs in enumerate(results) for e in errs]
    assert not errors, "\n".join(errors)


def test_every_point_to_point_pair_staged_through_host_equals_direct() -> None:
    """The path CUDA gradients take on gloo (on an H200 gloo could not send them point to point and
    the rank died: docs/gpu.md), emulated with CPU tensors: the staged replica equals the direct one
    bit for bit, its ranks stay identical, every pair really staged messages, and the byte counts
    are those of the direct sends (staging copies, it does not change what travels)."""
    from test_engine_overlap import PAIRS

    results = run_distributed(_staged_pairs, STAGE_WORLD, timeout=400)
    keys = {f"{n}/{c}" for n, c in PAIRS if c in _HAND_P2P}
    assert {c.split("/")[1] for c in keys} == _HAND_P2P  # every point-to-point collective is covered
    for r, got in enumerate(results):
        assert set(got) == keys
        for key, res in got.items():
            assert not res["mismatch"], f"rank {r} {key}: staged != direct at {res['mismatch']}"
            assert not res["diverged"], f"rank {r} {key}: ranks diverged at steps {res['diverged']}"
            assert res["staged_sends"] > 0, f"rank {r} {key}: nothing was staged"
            assert res["compressed"][0] == res["compressed"][1] > 0, (key, res)
            assert res["bytes"][0] == res["bytes"][1], (key, res)
