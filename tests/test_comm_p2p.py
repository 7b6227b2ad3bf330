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
# refusal of point-to-point collectives where the backend cannot send the payloads' device
# ------------------------------------------------------------------------------------------
# written out by hand from what each exchange does (not the library's own set): the collectives
# whose payloads travel by our isend/irecv rings and trees
_HAND_P2P = {"ring", "tree", "art_ring", "art_tree", "auto_sparse", "marsit", "marsit_cascade", "gradiveq_ring"}


@pytest.fixture
def gloo_world_of_one():
    store = dist.HashStore()
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()


def test_point_to_point_collectives_refused_for_cuda_tensors_on_gloo(gloo_world_of_one) -> None:
    """gloo has no isend/irecv of CUDA tensors (on an H200 a rank died at its first ring step:
    docs/gpu.md); every P2P collective is refused up front with the fix, nothing else is."""
    from lightning_gc.comm.registry import available_collectives, compatible_collectives, make_exchange
    from lightning_gc.compressors import available_compressors, build_compressor, takes_ratio

    seen = set()
    for name in available_compressors():
        comp = build_compressor(name, ratio=0.1 if takes_ratio(name) else None)
        for coll in compatible_collectives(comp):
            seen.add(coll)
            make_exchange(comp, coll, gloo_world_of_one, device=torch.device("cpu"))  # gloo sends CPU tensors
            make_exchange(comp, coll, None, device="cuda")  # world size 1: no group, nothing travels
            if coll in _HAND_P2P:
                with pytest.raises(ValueError, match=rf"collective '{coll}' sends CUDA tensors point to point.*"
                                                     r"'gloo' backend cannot.*NCCL backend") as err:
                    make_exchange(comp, coll, gloo_world_of_one, device="cuda")
                alternatives = [c for c in compatible_collectives(comp) if c not in _HAND_P2P]
                assert (str(alternatives) if alternatives else "another compressor") in str(err.value)
            else:
                make_exchange(comp, coll, gloo_world_of_one, device="cuda")
    assert seen == set(available_collectives())  # every collective was judged


def test_auto_default_slot_avoids_point_to_point_for_cuda_on_gloo(gloo_world_of_one) -> None:
    """compressor='auto' keeps AR-Topk's auto_sparse in the engine's default slot; on a GPU with gloo
    (2 ranks on one H200, docs/gpu.md) that slot was refused at setup, so auto could not run there at
    all. Its default slot now falls back to a collective gloo can send (Top-k over allgather) where,
    and only where, the point-to-point one cannot travel."""
    from types import SimpleNamespace

    from lightning_gc import GCStrategy
    from lightning_gc.comm.registry import make_exchange
    from lightning_gc.compressors import build_compressor

    strategy = GCStrategy(compressor="auto")
    strategy._model = None  # no DDP wrapper here: the world group
    base = build_compressor("artopk_auto", ratio=0.01)
    cuda_param = [("w", SimpleNamespace(device=torch.device("cuda", 0)))]
    on_cuda, collective = strategy._auto_default_compressor(base, cuda_param)
    assert (on_cuda.name, collective) == ("topk", "allgather")
    # the engine is built with the returned collective: the configured auto_sparse cannot carry Top-k
    # (a GPU run failed there when only the compressor fell back)
    assert strategy._engine_config.collective == "auto_sparse"
    make_exchange(on_cuda, collective, gloo_world_of_one, device="cuda")  # allgather: gloo can send it
    on_cpu, collective = strategy._auto_default_compressor(base, [("w", torch.zeros(2))])
    assert on_cpu is base and collective == "auto_sparse"  # CPU gradients on gloo: the P2P default stays


def _refused_before_new_group(rank: int, ws: int) -> dict:
    import lightning_gc.comm.registry as registry
    from lightning_gc.compressors import build_compressor
    from lightning_gc.engine import EngineConfig, GCEngine

    real = registry.check_point_to_point
    registry.check_point_to_point = lambda comp, coll, group, device: real(comp, coll, group, "cuda")
    calls = []
    new_group = dist.new_group
    dist.new_group = lambda *a, **k: calls.append(a) or new_group(*a, **k)
    try:
        GCEngine(build_compressor("marsit"), EngineConfig(collective="marsit"),
                 list(torch.nn.Linear(4, 4).named_parameters()))
    except ValueError as exc:
        return {"refused": str(exc), "new_groups": len(calls)}
    finally:
        dist.new_group, registry.check_point_to_point = new_group, real
    return {"refused": "", "new_groups": len(calls)}


def test_engine_refuses_a_point_to_point_collective_before_any_collective() -> None:
    """The refusal comes before the engine's process group is made: ``new_group`` is a collective
    that connects every rank to every other, and a refusal after it let the rank that refused first
    close its sockets while the other was still connecting ("Connection closed by peer" instead of
    the refusal, on an H200: docs/gpu.md). Emulated here: the check answers as for CUDA on gloo."""
    for r, got in enumerate(run_distributed(_refused_before_new_group, 2)):
        assert "point to point" in got["refused"] and "NCCL" in got["refused"], (r, got)
        assert got["new_groups"] == 0, (r, got)


_AUTO_FALLBACK_SCRIPT = """
import sys, lightning as L
sys.path.insert(0, {tests!r})
import lightning_gc.comm.registry as registry
from lightning_gc import GCStrategy
from lit_models import TinyClassifier, make_loader

real = registry.check_point_to_point
def as_if_on_cuda(compressor, collective, group, device):  # the check's answer for CUDA gradients on gloo
    return real(compressor, collective, group, "cuda")
registry.check_point_to_point = as_if_on_cuda

trainer = L.Trainer(strategy=GCStrategy(compressor="auto"), accelerator="cpu", devices=2, max_steps=4,
                    logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
trainer.fit(TinyClassifier(), make_loader())
engine = trainer.strategy.engine
with open(f"result_rank{{trainer.global_rank}}.txt", "w") as fh:
    fh.write(f"{{engine.compressor.name}} {{engine.exchange.name}} {{engine.step}}")
"""


def test_auto_trains_where_its_point_to_point_default_cannot_travel(tmp_path) -> None:
    """The whole path, in a Lightning fit on 2 processes: where the point-to-point check refuses
    auto_sparse (emulated here; on a GPU it is gloo with CUDA gradients), the engine is built with the
    fallback's compressor *and* collective. A fallback of the compressor alone raised at setup
    ("'topk' cannot travel by collective='auto_sparse'"), which only a GPU run showed."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    tests = Path(__file__).resolve().parent
    script = tmp_path / "auto_fallback.py"
    script.write_text(_AUTO_FALLBACK_SCRIPT.format(tests=str(tests)))
    env = {**os.environ, "PYTHONWARNINGS": "ignore::DeprecationWarning"}
    proc = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = sorted(p.read_text() for p in tmp_path.glob("result_rank*.txt"))
    assert results == ["topk allgather 4"] * 2, results
