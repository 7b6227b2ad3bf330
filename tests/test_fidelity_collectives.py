"""Every allgather / allreduce / AR-Topk collective at 2, 3 and 4 ranks against references built
by hand from all ranks' inputs.

Each rank runs the real exchange (the object the engine uses: allgather of packed bytes, the
backend's allreduce, the P2P ring or tree, AR-Topk's index broadcast and value reduction) on a
rank-dependent input, all-gathers every rank's input, and compares the mean with a reference that
never calls the code under test: top-k sets from ``torch.topk``, majority votes and one-bit scales
counted per coordinate, QSGD levels checked against the bucket norms by hand, AR-Topk's source
chosen by ``step mod N`` or by the per-rank energies computed here (lowest rank on an exact tie).
Byte counts are pinned to closed forms summed over ranks (every chunk of a ring travels N − 1
times per phase, every non-root rank of a tree sends once up and receives once down, a binomial
broadcast delivers N − 1 copies), so a per-rank index that is right only at one world size shows.

The input scales rotate with the step, so no rank — the last one in particular — has the largest
values at every step; even world sizes have exact vote ties and the test asserts it does.
"""

from __future__ import annotations

import math

import pytest
import torch
from dist_harness import gather_all, run_distributed

from lightning_gc.comm.exchange import ExchangeTimes, SparseSent, Timer
from lightning_gc.compressors import GroupContext, build_compressor, takes_ratio
from lightning_gc.exchanges.registry import make_exchange

SEGMENTS = (700, 37, 563)  # uneven layers: layer-wise Top-k differs from global Top-k here
NUMEL = sum(SEGMENTS)
RATIO = 0.05
STEPS = (1, 2)  # two steps: STAR's source and the rotating scales both move
SCALES = (1.0, 2.5, 0.7, 1.6)


def _p(rank: int, step: int, salt: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(100_003 * salt + 1009 * step + rank)
    x = torch.randn(NUMEL, generator=g) * SCALES[(rank + step) % len(SCALES)]
    x[SEGMENTS[0]:SEGMENTS[0] + SEGMENTS[1]] *= 40.0  # the small layer dominates global Top-k
    return x


def _sign_input(rank: int, step: int) -> torch.Tensor:
    x = _p(rank, step, 7)
    x[(rank * 13 + step) % 97::97] = 0.0  # exact zeros count as positive (bit 1)
    return x


def _int_perm(rank: int, step: int, low_ranks: int) -> torch.Tensor:
    """Signed integers 1..NUMEL in a rank-dependent order: every rank's top-k energy is the same
    exactly representable sum; the first ``low_ranks`` ranks are halved (energy / 4, still exact)."""
    g = torch.Generator().manual_seed(31 * rank + step)
    x = (torch.randperm(NUMEL, generator=g) + 1).float()
    x[torch.rand(NUMEL, generator=g) < 0.5] *= -1
    return x * 0.5 if rank < low_ranks else x


def _ctx(rank: int, ws: int, step: int, gid: int) -> GroupContext:
    return GroupContext(step=step, rank=rank, world_size=ws, segments=SEGMENTS, group_id=gid, seed=3)


def _topk_dense(p: torch.Tensor, k: int) -> torch.Tensor:
    d = torch.zeros_like(p)
    idx = torch.sort(p.abs(), descending=True).indices[:k]
    d[idx] = p[idx]
    return d


def _kept(n: int) -> int:
    return min(n, max(1, math.ceil(RATIO * n)))


def _dense_of(sent) -> torch.Tensor:
    if isinstance(sent, SparseSent):
        d = torch.zeros(NUMEL)
        d[sent.indices.long()] = sent.values
        return d
    return sent


# ------------------------------------------------------------------------------- references
def _ref_sparse(name: str, ps: list[torch.Tensor]) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Mean and each rank's contribution for the Top-k family (torch.sort, no library selection)."""
    own = []
    for p in ps:
        if name == "lwtopk":
            parts, off = [], 0
            for n in SEGMENTS:
                parts.append(_topk_dense(p[off:off + n], _kept(n)))
                off += n
            own.append(torch.cat(parts))
        else:
            own.append(_topk_dense(p, _kept(NUMEL)))
    return sum(own) / len(ps), own


def _ref_vote(ps: list[torch.Tensor]) -> tuple[torch.Tensor, int]:
    """signSGD majority vote by counting, coordinate by coordinate; number of tied coordinates."""
    ws = len(ps)
    pos = sum((p >= 0).long() for p in ps)  # ranks voting +1 (zero counts as positive)
    vote = torch.zeros(NUMEL)
    vote[2 * pos > ws] = 1.0
    vote[2 * pos < ws] = -1.0
    scale = sum(float(p.double().abs().sum()) / NUMEL for p in ps) / ws
    return vote * scale, int((2 * pos == ws).sum())


def _artopk_source(name: str, ps: list[torch.Tensor], step: int) -> int:
    ws = len(ps)
    if name == "star_topk":
        return step % ws
    k = _kept(NUMEL)
    energies = [float(torch.sort(p.abs().double(), descending=True).values[:k].pow(2).sum()) for p in ps]
    best = max(energies)
    return min(r for r, e in enumerate(energies) if e == best)  # lowest rank on ties


# ------------------------------------------------------------------------------- one spawn per N
CASES = [  # (compressor, collective, input)
    ("topk", "allgather", "randn"), ("lwtopk", "allgather", "randn"), ("mstopk", "allgather", "randn"),
    ("randomk", "allreduce", "randn"), ("randomk", "ring", "randn"), ("randomk", "tree", "randn"),
    ("qsgd", "allgather", "randn"), ("signsgd", "allgather", "sign"), ("efsignsgd", "allgather", "sign"),
] + [(n, c, "randn") for n in ("star_topk", "var_topk") for c in ("art_allreduce", "art_ring", "art_tree")] + [
    ("var_topk", c, "tie") for c in ("art_allreduce", "art_tree")
]


def _input(kind: str, rank: int, step: int, salt: int) -> torch.Tensor:
    if kind == "sign":
        return _sign_input(rank, step)
    if kind == "tie":  # step 1: every rank ties (source 0); step 2: rank 0 lower, the rest tie (source 1)
        return _int_perm(rank, step, low_ranks=step - 1)
    return _p(rank, step, salt)


def _worker(rank: int, ws: int) -> dict:
    out = {}
    for case, (name, coll, kind) in enumerate(CASES):
        comp = build_compressor(name, ratio=RATIO if takes_ratio(name) else None)
        ex = make_exchange(comp, coll)
        res = []
        for step in STEPS:
            p = _input(kind, rank, step, case)
            times = ExchangeTimes()
            mean, sent = ex.run(p.clone(), _ctx(rank, ws, step, case), Timer(torch.device("cpu"), times))
            res.append({"step": step, "mean": mean, "sent": _dense_of(sent), "bytes": times.bytes_sent,
                        "all_p": gather_all(p, ws), "all_bytes": gather_all(torch.tensor([times.bytes_sent]), ws),
                        "all_sent": gather_all(_dense_of(sent).contiguous(), ws)})
        out[f"{name}/{coll}/{kind}"] = res
    return out


# ws4 (13 s on 2 cores) with -m extended: tests/test_comm_p2p.py checks the ring and tree at 4 ranks
@pytest.fixture(scope="module", params=[2, 3, pytest.param(4, marks=pytest.mark.extended)], ids=lambda n: f"ws{n}")
def spawned(request):
    ws = request.param
    return ws, run_distributed(_worker, ws, timeout=300)


def _aligned(nbytes: int) -> int:
    return nbytes + (-nbytes) % 8


def test_every_rank_gets_the_same_mean(spawned):
    ws, results = spawned
    for key in results[0]:
        for r in range(1, ws):
            for a, b in zip(results[0][key], results[r][key]):
                assert torch.equal(a["mean"], b["mean"]), f"ws={ws} {key} step {a['step']}: rank {r} differs from rank 0"


@pytest.mark.parametrize("name", ["topk", "lwtopk", "mstopk"])
def test_topk_family_allgather_matches_hand_topk(spawned, name):
    ws, results = spawned
    k_numel = sum(_kept(n) for n in SEGMENTS) if name == "lwtopk" else _kept(NUMEL)
    for r in range(ws):
        for st in results[r][f"{name}/allgather/randn"]:
            ref, own = _ref_sparse(name, st["all_p"])
            assert torch.allclose(st["mean"], ref, rtol=1e-6, atol=1e-7), f"ws={ws} {name} rank {r} step {st['step']}"
            assert torch.equal(st["sent"], own[r])
            # allgather: every rank forwards N − 1 payloads of k fp32 values + k int32 indices
            assert st["bytes"] == (ws - 1) * 2 * _aligned(4 * k_numel)
    if name == "lwtopk":  # the data makes layer-wise and global selection differ
        ps = results[0]["lwtopk/allgather/randn"][0]["all_p"]
        assert not torch.equal(_ref_sparse("lwtopk", ps)[0], _ref_sparse("topk", ps)[0])


@pytest.mark.parametrize("coll", ["allreduce", "ring", "tree"])
def test_randomk_sum_at_shared_positions(spawned, coll):
    ws, results = spawned
    k = _kept(NUMEL)
    supports = []
    for st in results[0][f"randomk/{coll}/randn"]:
        support = torch.nonzero(st["mean"]).flatten()
        assert support.numel() == k, f"ws={ws} randomk/{coll}: {support.numel()} non-zeros, want k={k}"
        supports.append(support)
        ref = torch.zeros(NUMEL)
        ref[support] = sum(p[support] for p in st["all_p"]) * (NUMEL / k) / ws
        assert torch.allclose(st["mean"], ref, rtol=1e-5, atol=1e-6), f"ws={ws} randomk/{coll} step {st['step']}"
        for r, s in enumerate(st["all_sent"]):  # every rank sent p·n/k at those same positions
            want = torch.zeros(NUMEL)
            want[support] = st["all_p"][r][support] * (NUMEL / k)
            assert torch.allclose(s, want, rtol=1e-6), f"ws={ws} randomk/{coll} rank {r}"
        total = int(sum(st["all_bytes"]).item())
        if coll == "allreduce" and (ws - 1) * 4 * k <= 12 * 1024:
            # the direct exchange (docs/cost_model.md): each rank sends the 4k-byte message to the N − 1 others
            assert total == ws * (ws - 1) * 4 * k
        elif coll == "allreduce":  # the backend's ring, modelled: each rank 2(N−1)/N of the 4k-byte message
            assert total == ws * round(2 * (ws - 1) * 4 * k / ws)
        else:  # ring: every chunk travels N − 1 times per phase; tree: N − 1 messages up, N − 1 down
            assert total == 2 * (ws - 1) * 4 * k
    assert not torch.equal(supports[0], supports[1])  # fresh positions every step


def test_qsgd_mean_is_the_mean_of_each_ranks_hand_checked_levels(spawned):
    ws, results = spawned
    s, bs = 7, 512
    for st in results[0]["qsgd/allgather/randn"]:
        for r, (p, q) in enumerate(zip(st["all_p"], st["all_sent"])):
            for b0 in range(0, NUMEL, bs):
                norm = float(p[b0:b0 + bs].double().norm())
                scaled = s * p[b0:b0 + bs].double().abs() / norm
                level = q[b0:b0 + bs].double().abs() * s / norm
                assert torch.allclose(level, level.round(), atol=1e-4), (ws, r, b0)
                # an adjacent level: floor or ceil of s|x|/norm (widened by 1e-5 where fp32 and fp64
                # norms could put s|x|/norm on either side of an integer)
                lo, hi = (scaled - 1e-5).floor(), (scaled + 1e-5).ceil()
                assert bool(((level.round() >= lo) & (level.round() <= hi)).all()), (ws, r, b0)
                nz = q[b0:b0 + bs] != 0
                assert torch.equal(torch.sign(q[b0:b0 + bs][nz]), torch.sign(p[b0:b0 + bs][nz]))
        ref = sum(q.double() for q in st["all_sent"]) / ws
        assert torch.allclose(st["mean"].double(), ref, rtol=1e-5, atol=1e-6), f"ws={ws} step {st['step']}"
        assert not torch.equal(st["all_sent"][0], st["all_p"][0])  # something was quantised


def test_signsgd_majority_vote_and_ties_by_counting(spawned):
    ws, results = spawned
    ties = 0
    for st in results[0]["signsgd/allgather/sign"]:
        ref, t = _ref_vote(st["all_p"])
        ties += t
        assert torch.allclose(st["mean"], ref, rtol=1e-5), f"ws={ws} step {st['step']}"
        assert bool((st["mean"][ref == 0] == 0).all())  # a tie is exactly 0
        # one byte of packed bits per 8 elements plus one fp32 scale, forwarded N − 1 times
        assert st["bytes"] == (ws - 1) * (8 + _aligned((NUMEL + 7) // 8))
    if ws % 2 == 0:
        assert ties > 50, f"ws={ws}: only {ties} tied coordinates, the tie rule is not exercised"
    else:
        assert ties == 0


def test_efsignsgd_mean_of_scaled_signs(spawned):
    ws, results = spawned
    for st in results[0]["efsignsgd/allgather/sign"]:
        own = [torch.where(p >= 0, 1.0, -1.0) * float(p.double().abs().mean()) for p in st["all_p"]]
        assert torch.allclose(st["mean"], sum(own) / ws, rtol=1e-5), f"ws={ws} step {st['step']}"
        for r, s in enumerate(st["all_sent"]):
            assert torch.allclose(s, own[r], rtol=1e-6)


@pytest.mark.parametrize("name", ["star_topk", "var_topk"])
@pytest.mark.parametrize("coll", ["art_allreduce", "art_ring", "art_tree"])
def test_artopk_source_indices_and_summed_values(spawned, name, coll):
    ws, results = spawned
    k = _kept(NUMEL)
    sources = []
    for st in results[0][f"{name}/{coll}/randn"]:
        src = _artopk_source(name, st["all_p"], st["step"])
        sources.append(src)
        idx = torch.sort(st["all_p"][src].abs(), descending=True).indices[:k]
        ref = torch.zeros(NUMEL)
        ref[idx] = sum(p[idx] for p in st["all_p"]) / ws
        assert torch.allclose(st["mean"], ref, rtol=1e-5, atol=1e-6), f"ws={ws} {name}/{coll} step {st['step']}"
        for r, s in enumerate(st["all_sent"]):  # error feedback keeps p_r − p_r[idx_src] on every rank
            want = torch.zeros(NUMEL)
            want[idx] = st["all_p"][r][idx]
            assert torch.equal(s, want), f"ws={ws} {name}/{coll} rank {r}"
        total = int(sum(st["all_bytes"]).item())
        values = 4 * k
        bcast = (ws - 1) * 4 * k  # the source's indices reach N − 1 ranks (flat or binomial)
        reduce = ws * round(2 * (ws - 1) * values / ws) if coll == "art_allreduce" else 2 * (ws - 1) * values
        energy = ws * (ws - 1) * 8 if name == "var_topk" else 0  # VAR: allgather of one float64
        assert total == bcast + reduce + energy, (ws, name, coll, total, bcast, reduce, energy)
    if name == "star_topk":
        assert sources == [s % ws for s in STEPS]
    else:  # the data does not let the last rank (or any one rank) win every step
        assert len(set(sources)) > 1, sources


@pytest.mark.parametrize("coll", ["art_allreduce", "art_tree"])
def test_var_exact_energy_tie_goes_to_the_lowest_rank(spawned, coll):
    ws, results = spawned
    k = _kept(NUMEL)
    for st, want_src in zip(results[0][f"var_topk/{coll}/tie"], (0, 1)):
        ps = st["all_p"]
        energies = [float(torch.sort(p.abs().double(), descending=True).values[:k].pow(2).sum()) for p in ps]
        assert energies.count(max(energies)) == ws - want_src >= 1  # the tie the step is built for
        assert _artopk_source("var_topk", ps, st["step"]) == want_src
        idx = torch.sort(ps[want_src].abs(), descending=True).indices[:k]
        ref = torch.zeros(NUMEL)
        ref[idx] = sum(p[idx] for p in ps) / ws
        assert torch.allclose(st["mean"], ref, rtol=1e-6), f"ws={ws} {coll} step {st['step']}: not rank {want_src}'s indices"
        # the tied ranks' index sets differ, so another tie rule would give another mean
        for other in range(want_src + 1, ws):
            alt = torch.sort(ps[other].abs(), descending=True).indices[:k]
            assert set(alt.tolist()) != set(idx.tolist())
