"""GradiVeQ: slicing rule, basis fit (Eq. 6), linearity (Eq. 4), the ring of Algorithm 1, schedule.

Oracles (the expected values never come from the code under test):

* packing: each element's packed position is computed by a loop from the paper's order (the F
  filters of one (depth, position) together, then depth, then position);
* the basis: the covariance of the sampled aggregated slices is rebuilt by hand from the means the
  exchange returned on the sample steps (centred per slice), eigen-decomposed, d chosen by a loop
  over Eq. 6; the fitted projector U Uᵀ, d and μ̄ must match;
* linearity (Eq. 4): Σ_r Q(g_r), summed by a real allreduce of what each rank's compressor sent,
  equals Uᵀ(Σ_r x_r − N μ̄) computed by hand from all ranks' gradients;
* the decompressed mean equals P(x̄ − μ̄) + μ̄ with P = U Uᵀ (exact tensors: the exact mean);
* the ring of Algorithm 1 returns the simple allreduce path's result on every rank;
* U and μ̄ are bit-identical on every rank; with d = K the method returns the dense mean;
* under DDP + the engine with error feedback: the optimizer's gradient is the mean of
  U Uᵀ(p_r − μ̄) + μ̄ over ranks and the memory is p − (U Uᵀ(p − μ̄) + μ̄), p = g + e.

Rank-dependent inputs: every rank adds its own noise with its own scale (rank 0 the smallest on
one tensor, the largest on another), so a missing or partial reduction shows.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from dist_harness import gather_all, run_distributed
from torch.nn.parallel import DistributedDataParallel as DDP

from lightning_gc import GCStrategy
from lightning_gc.comm.exchange import ExchangeTimes, Timer
from lightning_gc.compressors import GroupContext, build_compressor
from lightning_gc.compressors.gradiveq import GradiVeQCompressor, GradiVeQConfig, slice_rule
from lightning_gc.engine import EngineConfig, GCEngine, gc_comm_hook
from lightning_gc.exchanges.gradiveq import GradiVeQExchange, GradiVeQRingExchange, chunk_plan, pieces_of
from lightning_gc.exchanges.registry import make_exchange, validate_collective


# ----------------------------------------------------------------------------- config, registry
@pytest.mark.parametrize("kwargs,match", [
    ({"lam": 1.0}, r"lam=1.0 is invalid.*\[0, 1\)"),
    ({"lam": -0.1}, r"lam=-0.1 is invalid"),
    ({"max_slice": 1}, r"max_slice=1 is invalid"),
    ({"reuse": -1}, r"reuse=-1 is invalid"),
    ({"sample_steps": 1}, r"sample_steps=1 is invalid.*≥ 2"),
    ({"compress_steps": 0}, r"compress_steps=0 is invalid"),
    ({"loss_threshold": 0}, r"loss_threshold=0 is invalid"),
    ({"sample_levels": -1}, r"sample_levels=-1 is invalid"),
    ({"dim": 0}, r"dim=0 is invalid"),
    ({"compress_linear": 1}, r"compress_linear=1 must be True or False"),
    ({"coef_dtype": "float16"}, r"coef_dtype='float16' is invalid.*'bfloat16'"),
    ({"outside_span": "none"}, r"outside_span='none' is invalid.*'zero'"),
])
def test_config_rejects_bad_values(kwargs, match):
    with pytest.raises(ValueError, match=match):
        GradiVeQConfig(**kwargs)


def test_strategy_alias_collectives():
    s = GCStrategy(compressor="gradiveq", compressor_args={"sample_steps": 5})
    assert s.config.engine.collective == "gradiveq_ring" and s.config.compression.compressor_config().sample_steps == 5
    from lightning.pytorch.strategies import StrategyRegistry

    assert StrategyRegistry["gc_gradiveq"]["init_params"]["compressor"] == "gradiveq"
    comp = build_compressor("gradiveq")
    assert validate_collective(comp, "gradiveq_allreduce") == "gradiveq_allreduce"
    with pytest.raises(ValueError, match=r"cannot travel by collective='allgather'"):
        validate_collective(comp, "allgather")
    with pytest.raises(ValueError, match="needs compressor='gradiveq'"):
        GradiVeQRingExchange(build_compressor("qsgd"))
    with pytest.raises(ValueError, match="cannot travel by collective='gradiveq_ring'"):
        make_exchange(build_compressor("qsgd"), "gradiveq_ring")
    # defaults: a small model compresses by step 100
    c = GradiVeQConfig()
    assert c.warmup + c.sample_steps <= 100 and c.lam == 0.01


# ----------------------------------------------------------------------------- slicing
def test_slice_rule_follows_the_paper_and_the_documented_fallbacks():
    assert slice_rule((16, 16, 3, 3), 1024) == (16, 16, 9, 768)  # the paper's example: 3·F·D
    assert slice_rule((512, 512, 3, 3), 1024) == (512, 512, 9, 1024)  # F·D too large: K = F·m
    assert slice_rule((10, 512), 1024)[3] == 640  # linear: F = out, m | in
    assert slice_rule((16, 8), 1024)[3] == 128  # small linear: one slice of F·D
    assert slice_rule((2048, 3), 1024)[3] == 1024  # F > max_slice: largest divisor of the size


def _ref_index(F: int, D: int, P: int) -> torch.Tensor:
    """Flat parameter index of each packed position, by the paper's order (loops, not permute)."""
    idx = []
    for p in range(P):
        for d in range(D):
            for f in range(F):
                idx.append((f * D + d) * P + p)
    return torch.tensor(idx)


def _ref_pack(flat: torch.Tensor, F: int, D: int, P: int, K: int) -> torch.Tensor:
    return flat[_ref_index(F, D, P)].view(-1, K)


def _ref_unpack(rows: torch.Tensor, F: int, D: int, P: int) -> torch.Tensor:
    out = torch.empty(rows.numel(), dtype=rows.dtype)
    out[_ref_index(F, D, P)] = rows.reshape(-1)
    return out


def test_packing_matches_the_papers_order_and_chunks_align_to_slices():
    from lightning_gc.compressors.gradiveq import layout

    ctx = GroupContext(step=0, rank=0, world_size=3, segments=(288, 480, 12),
                       shapes=((8, 4, 3, 3), (12, 40), (12,)))
    layers = layout(ctx, GradiVeQConfig(max_slice=96))
    assert [(L.exact, L.K) for L in layers] == [(False, 96), (False, 96), (True, 0)]
    flat = torch.randn(780)
    for L in layers[:2]:
        assert torch.equal(L.pack(flat), _ref_pack(flat[L.offset:L.offset + L.numel], L.F, L.D, L.P, L.K))
        back = torch.zeros(780)
        L.unpack_into(L.pack(flat), back)
        assert torch.equal(back[L.offset:L.offset + L.numel], flat[L.offset:L.offset + L.numel])


# ----------------------------------------------------------------------------- schedule
def test_schedule_warmup_alternation_and_early_stop():
    comp = GradiVeQCompressor(GradiVeQConfig(warmup=2, sample_steps=3, compress_steps=4))
    phases = [comp.phase(s) for s in range(14)]
    assert phases == ["warmup"] * 2 + ["sample"] * 3 + ["compress"] * 4 + ["sample"] * 3 + ["compress"] * 2
    comp = GradiVeQCompressor(GradiVeQConfig(warmup=0, sample_steps=2, compress_steps=5))
    assert [comp.phase(s) for s in range(3)] == ["sample", "sample", "compress"]
    assert not comp.vote(1.0, 3)  # a minority of 3 ranks does not stop
    assert comp.phase(3) == "compress"
    assert comp.vote(2.0, 3)  # a majority does: the next step samples again
    assert [comp.phase(s) for s in (4, 5, 6)] == ["sample", "sample", "compress"]


# ----------------------------------------------------------------------------- distributed oracles
SHAPES = ((8, 4, 3, 3), (12, 40), (12,))
SEGS = (288, 480, 12)
KS = {0: (8, 4, 9, 96), 1: (12, 40, 1, 96)}  # (F, D, P, K) per compressed tensor, max_slice=96
LAM = 0.02
STEPS = 8  # 0 warm-up, 1-4 sample, 5-7 compressed


def _grad(rank: int, ws: int, step: int) -> torch.Tensor:
    """Low-rank common signal in the packed domain plus rank-dependent noise."""
    g0 = torch.Generator().manual_seed(7)
    parts = []
    for i, (F, D, P, K) in KS.items():
        rows = F * D * P // K
        base = torch.randn(rows, K, generator=g0)
        B = torch.randn(K, 3, generator=g0)
        gt = torch.Generator().manual_seed(100 + step * 10 + i)
        rows_t = base + torch.randn(rows, 3, generator=gt) @ B.T * 2.0
        gr = torch.Generator().manual_seed(1000 * (rank + 1) + step * 10 + i)
        scale = 0.1 * (1 + rank) if i == 0 else 0.1 * (ws - rank)
        rows_t = rows_t + scale * torch.randn(rows, K, generator=gr)
        parts.append(_ref_unpack(rows_t, F, D, P))
    gr = torch.Generator().manual_seed(5000 + 1000 * rank + step)
    parts.append(torch.randn(12, generator=gr) * (1 + rank))
    return torch.cat(parts)



def _ctx(rank: int, ws: int, step: int) -> GroupContext:
    return GroupContext(step=step, rank=rank, world_size=ws, segments=SEGS, group_id=0, seed=1,
                        shapes=SHAPES, names=("conv.weight", "fc.weight", "fc.bias"))


def _oracle_run(rank: int, ws: int) -> dict:
    base = dict(max_slice=96, warmup=1, sample_steps=4, compress_steps=3, lam=LAM, pca_slices=2,
                loss_threshold=None, coef_dtype="float32", outside_span="mu")
    ring = GradiVeQRingExchange(GradiVeQCompressor(GradiVeQConfig(**base)))
    simple = GradiVeQExchange(GradiVeQCompressor(GradiVeQConfig(**base)))
    full = GradiVeQRingExchange(GradiVeQCompressor(GradiVeQConfig(**dict(base, dim=10_000))))
    stopper = GradiVeQRingExchange(GradiVeQCompressor(GradiVeQConfig(**dict(base, loss_threshold=1e-9))))
    ring16 = GradiVeQRingExchange(GradiVeQCompressor(GradiVeQConfig(**dict(base, coef_dtype="bfloat16"))))
    simple16 = GradiVeQExchange(GradiVeQCompressor(GradiVeQConfig(**dict(base, coef_dtype="bfloat16"))))
    proj = GradiVeQRingExchange(GradiVeQCompressor(GradiVeQConfig(**dict(base, outside_span="zero"))))
    out: dict = {"samples": [], "checks": [], "stop_phases": [], "stop_votes": []}
    for step in range(STEPS):
        p = _grad(rank, ws, step)
        ctx = _ctx(rank, ws, step)
        results = {}
        for name, ex in (("ring", ring), ("simple", simple), ("full", full), ("stopper", stopper),
                         ("ring16", ring16), ("simple16", simple16), ("proj", proj)):
            times = ExchangeTimes()
            mean, sent = ex.run(p.clone(), ctx, Timer(torch.device("cpu"), times))
            results[name] = (mean, sent, times)
        out["stop_phases"].append(results["stopper"][2].metrics["gradiveq/phase"])
        out["stop_votes"].append(results["stopper"][2].metrics.get("gradiveq/stop_votes"))
        phase = results["ring"][2].extra["metrics"]["gradiveq/phase"]
        if phase == 1.0:
            out["samples"].append(results["ring"][0].clone())
            assert torch.equal(results["ring"][0], results["simple"][0])  # same QSGD draws, same code
            continue
        if phase != 2.0:
            continue
        comp = ring.compressor
        basis = comp.bases[0]
        all_p = gather_all(p, ws)
        # linearity: Σ_r Q(g_r) by a real allreduce vs Uᵀ(Σ x − N μ̄) by hand
        z = comp.compress(p, ctx).payload[0].clone()
        dist.all_reduce(z)
        ref_z, ref_mean = [], torch.empty(780)
        for b in basis.blocks:
            F, D, P, K = KS[b.layer]
            L = basis.layers[b.layer]
            xs = [_ref_pack(q[L.offset:L.offset + L.numel], F, D, P, K) for q in all_p]
            mu = basis.mu[b.layer]
            ref_z.append(((sum(xs) - ws * mu) @ b.U).reshape(-1))
            xbar = sum(xs) / ws
            Pm = b.U @ b.U.T
            ref_mean[L.offset:L.offset + L.numel] = _ref_unpack((xbar - mu) @ Pm + mu, F, D, P)
        ref_z.append(sum(q[768:] for q in all_p))
        ref_mean[768:] = sum(q[768:] for q in all_p) / ws
        ref_z = torch.cat(ref_z)
        mean_ring, sent_ring, t_ring = results["ring"]

        def own_of(q: torch.Tensor, basis=basis) -> torch.Tensor:
            o = torch.empty(780)
            for b in basis.blocks:
                F, D, P, K = KS[b.layer]
                L = basis.layers[b.layer]
                x = _ref_pack(q[L.offset:L.offset + L.numel], F, D, P, K)
                o[L.offset:L.offset + L.numel] = _ref_unpack((x - basis.mu[b.layer]) @ b.U @ b.U.T + basis.mu[b.layer],
                                                             F, D, P)
            o[768:] = q[768:]
            return o

        own = own_of(p)
        # Eq. 7 by its definition (expanded contributions), mean over ranks of the relative loss
        ref_loss = sum(float((q[:768] - own_of(q)[:768]).pow(2).sum() / q[:768].pow(2).sum()) for q in all_p) / ws
        dense = sum(all_p) / ws
        mean16, _, t16 = results["ring16"]
        # outside_span="zero": the mean is P x̄ alone, a rank's contribution P x (by hand)
        ref_proj, own_proj = torch.empty(780), torch.empty(780)
        for b in basis.blocks:
            F, D, P, K = KS[b.layer]
            L = basis.layers[b.layer]
            xs = [_ref_pack(q[L.offset:L.offset + L.numel], F, D, P, K) for q in all_p]
            Pm = b.U @ b.U.T
            ref_proj[L.offset:L.offset + L.numel] = _ref_unpack((sum(xs) / ws) @ Pm, F, D, P)
            own_proj[L.offset:L.offset + L.numel] = _ref_unpack(_ref_pack(p[L.offset:L.offset + L.numel], F, D, P, K) @ Pm,
                                                                F, D, P)
        ref_proj[768:] = sum(q[768:] for q in all_p) / ws
        own_proj[768:] = p[768:]
        ref_proj_loss = sum(float((q[:768] - r[:768]).pow(2).sum() / q[:768].pow(2).sum())
                            for q, r in zip(all_p, gather_all(own_proj, ws))) / ws
        mean_p, sent_p, _ = results["proj"]
        out["checks"].append({
            "step": step,
            "lin": float((z - ref_z).abs().max() / ref_z.abs().max()),
            "mean": float((mean_ring - ref_mean).abs().max() / ref_mean.abs().max()),
            "ring_vs_simple": float((mean_ring - results["simple"][0]).abs().max() / ref_mean.abs().max()),
            "sent": float((sent_ring.materialise() - own).abs().max() / own.abs().max()),
            "sent_norm": abs(sent_ring.sq_norm - float(own.double().pow(2).sum())) / float(own.double().pow(2).sum()),
            "loss": abs(ring.last_loss[0] - ref_loss) / ref_loss,
            "bf16_vs_ref": float((mean16 - ref_mean).abs().max() / ref_mean.abs().max()),
            "bf16_ring_vs_simple": float((mean16 - results["simple16"][0]).abs().max() / ref_mean.abs().max()),
            "bf16_ranks_equal": all(torch.equal(a, mean16) for a in gather_all(mean16, ws)),
            "bf16_payload": t16.bytes_payload,
            "proj_mean": float((mean_p - ref_proj).abs().max() / ref_proj.abs().max()),
            "proj_sent": float((sent_p.materialise() - own_proj).abs().max() / own_proj.abs().max()),
            "proj_sent_norm": abs(sent_p.sq_norm - float(own_proj.double().pow(2).sum())) / float(own_proj.double().pow(2).sum()),
            "proj_loss": abs(proj.last_loss[0] - ref_proj_loss) / ref_proj_loss,
            "proj_vs_mu": float((mean_p - mean_ring).abs().max() / ref_mean.abs().max()),
            "full_vs_dense": float((results["full"][0] - dense).abs().max() / dense.abs().max()),
            "full_d": [b.d for b in full.compressor.bases[0].blocks],
            "proj_vs_dense": float((mean_ring - dense).abs().max() / dense.abs().max()),
            "ranks_equal": all(torch.equal(a, mean_ring) for a in gather_all(mean_ring, ws)),
            "bytes_payload": t_ring.bytes_payload,
            "bytes_sent": t_ring.bytes_sent,
            "z_numel": basis.z_numel,
            "ratio_metric": t_ring.metrics["gradiveq/ratio"],
            "comp_ratio": comp.payload_fraction,
        })
        out["U"] = [b.U.clone() for b in basis.blocks]
        out["d"] = [b.d for b in basis.blocks]
        out["mu"] = {k: v.clone() for k, v in basis.mu.items()}
        out["digest"] = basis.digest
    return out


def _ref_fit(samples: list[torch.Tensor]) -> dict:
    """Eq. 6 by hand from the aggregated sample means (float64, per-slice centring)."""
    ref = {}
    for i, (F, D, P, K) in KS.items():
        off = sum(SEGS[:i])
        Xs = [_ref_pack(s[off:off + SEGS[i]].double(), F, D, P, K) for s in samples]
        rows = Xs[0].shape[0]
        m = min(2, rows)
        picked = [r * rows // m for r in range(m)]
        vecs = []
        for r in picked:
            col = torch.stack([X[r] for X in Xs])
            vecs.append(col - col.mean(0))
        V = torch.cat(vecs)
        evals, evecs = torch.linalg.eigh(V.T @ V)
        evals, evecs = evals.flip(0).clamp_min(0), evecs.flip(1)
        total, acc, d = float(evals.sum()), 0.0, K
        for k in range(K):
            acc += float(evals[k])
            if acc / total >= 1 - LAM:
                d = k + 1
                break
        ref[i] = {"d": d, "P": evecs[:, :d] @ evecs[:, :d].T, "mu": sum(Xs) / len(Xs)}
    return ref


def _all_runs(rank: int, ws: int) -> dict:
    """One spawn for every distributed check (spawning ranks costs far more than the checks)."""
    return {"oracle": _oracle_run(rank, ws), "engine": _engine_run(rank, ws)}


# ws4 (11 s on 2 cores) with -m extended
@pytest.fixture(scope="module", params=[2, 3, pytest.param(4, marks=pytest.mark.extended)], ids=lambda n: f"ws{n}")
def all_results(request):
    """Even and odd world sizes: a ring chunk index or a vote count right at one size only shows."""
    return run_distributed(_all_runs, request.param, timeout=400)


@pytest.fixture(scope="module")
def oracle_results(all_results):
    return [r["oracle"] for r in all_results]


def test_basis_is_eq6_of_the_sampled_aggregates_and_identical_on_all_ranks(oracle_results):
    res = oracle_results
    assert len(res[0]["samples"]) == 4
    ref = _ref_fit(res[0]["samples"])
    for i, U in enumerate(res[0]["U"]):
        assert res[0]["d"][i] == ref[i]["d"], (i, res[0]["d"], ref[i]["d"])
        assert 1 < ref[i]["d"] < 96  # a real reduction, not everything or nothing
        assert torch.allclose((U @ U.T).double(), ref[i]["P"], atol=1e-5)
        assert torch.allclose(res[0]["mu"][i].double(), ref[i]["mu"], atol=1e-5)
    # z: rows·d per compressed tensor (288/96 = 3 and 480/96 = 5 rows) plus the 12 exact values;
    # the ratio reported (metric and compressor) is z elements per gradient element
    z = 3 * ref[0]["d"] + 5 * ref[1]["d"] + 12
    for r in res:
        for c in r["checks"]:
            assert c["z_numel"] == z, (c["z_numel"], z)
            assert c["ratio_metric"] == pytest.approx(z / 780, rel=1e-12)
            assert c["comp_ratio"] == pytest.approx(z / 780, rel=1e-12)
    for r in res[1:]:
        assert r["digest"] == res[0]["digest"]
        assert all(torch.equal(a, b) for a, b in zip(r["U"], res[0]["U"]))
        assert all(torch.equal(r["mu"][k], res[0]["mu"][k]) for k in res[0]["mu"])


def test_linearity_projection_identity_and_ring_equals_allreduce(oracle_results):
    n = len(oracle_results)
    for i, step in enumerate((5, 6, 7)):
        # bytes over all ranks, closed form: each ring chunk of z travels N − 1 times in each round
        # (4 bytes per coefficient), plus the 16-byte vote allreduce (modelled 2(N−1)/N of it per
        # rank) and, on the fitting step, the 8-byte digest allgather ((N − 1)·8 per rank)
        total = sum(res["checks"][i]["bytes_sent"] for res in oracle_results)
        z = oracle_results[0]["checks"][i]["z_numel"]
        want = 2 * (n - 1) * 4 * z + n * round(2 * (n - 1) * 16 / n) + (n * (n - 1) * 8 if step == 5 else 0)
        assert total == want, (n, step, total, want)
    for r, res in enumerate(oracle_results):
        assert [c["step"] for c in res["checks"]] == [5, 6, 7]
        for c in res["checks"]:
            assert c["lin"] < 1e-5, (r, c)
            assert c["mean"] < 1e-5, (r, c)
            assert c["ring_vs_simple"] < 1e-5, (r, c)
            assert c["sent"] < 1e-5, (r, c)
            assert c["sent_norm"] < 1e-5, (r, c)  # ‖U z + μ̄‖² from z alone
            assert c["loss"] < 1e-5, (r, c)  # ‖x − μ̄‖² − ‖z‖² is Eq. 7
            # bfloat16 coefficients: the same result up to bf16 rounding of the (partial) sums,
            # identical on every rank, and half the payload
            assert c["bf16_vs_ref"] < 2e-2 and c["bf16_ring_vs_simple"] < 2e-2, (r, c)
            assert c["bf16_ranks_equal"], (r, c)
            assert c["bf16_payload"] == 2 * c["z_numel"], (r, c)
            # outside_span="zero": P x̄ and P x by hand, norms and Eq. 7 from z alone; differs from Eq. 5
            for key in ("proj_mean", "proj_sent", "proj_sent_norm", "proj_loss"):
                assert c[key] < 1e-5, (r, key, c)
            assert c["proj_vs_mu"] > 1e-3, (r, c)
            assert c["ranks_equal"], (r, c)
            assert c["proj_vs_dense"] > 1e-3  # the projection really drops something
            assert c["bytes_payload"] == 4 * c["z_numel"]


def test_full_dimension_reproduces_dense_and_early_stop_is_agreed(oracle_results):
    for res in oracle_results:
        for c in res["checks"]:
            assert c["full_d"] == [96, 96]
            assert c["full_vs_dense"] < 1e-5, c
        # loss above the threshold on every rank: one compressed step, then sampling again
        assert res["stop_phases"] == [0.0, 1.0, 1.0, 1.0, 1.0, 2.0, 1.0, 1.0]
        assert res["stop_votes"][5] == len(oracle_results)  # every rank's vote, summed


def test_chunk_plan_boundaries_fall_on_slices():
    from lightning_gc.compressors.gradiveq import Block, GroupBasis, LayerSlicing

    layers = [LayerSlicing(0, "a", 0, 960, (96, 10), False, 96, 10, 1, 96), LayerSlicing(1, "b", 960, 7, (7,), True)]
    basis = GroupBasis(layers, [Block(0, 0, 10, torch.zeros(96, 5), torch.zeros(96))], {})
    pieces = pieces_of(basis)
    for n in (2, 3, 4, 7):
        chunks = chunk_plan(pieces, n)
        assert len(chunks) == n
        assert sum(pc.numel for ch in chunks for pc in ch) == 57
        for ch in chunks:
            for pc in ch:
                assert pc.block < 0 or 0 <= pc.a < pc.b <= 10  # whole rows of the block


# ----------------------------------------------------------------------------- engine + DDP, error feedback
def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), torch.nn.Tanh(), torch.nn.Flatten(),
                               torch.nn.Linear(128, 5))


def _batch(rank: int, step: int):
    g = torch.Generator().manual_seed(1000 * rank + step)
    return torch.randn(8, 3, 6, 6, generator=g) * (1 + rank), torch.randint(0, 5, (8,), generator=g)


def _engine_run(rank: int, ws: int) -> dict:
    model = _model()
    replica = copy.deepcopy(model)
    ddp = DDP(model, bucket_cap_mb=0.002)
    comp = build_compressor("gradiveq", args=dict(max_slice=64, min_numel=100, warmup=2, sample_steps=3, compress_steps=3,
                                                  sample_levels=0, loss_threshold=None, pca_slices=4,
                                                  coef_dtype="float32", outside_span="mu"))
    engine = GCEngine(comp, EngineConfig(warmup_steps=1, min_compress_numel=100, seed=3, error_feedback=True),
                      list(model.named_parameters()))
    ddp.register_comm_hook(engine, gc_comm_hook)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    mem: dict = {}
    worst_grad = worst_mem = 0.0
    compressed = 0
    metrics = []
    ref_loss = None
    gains = []
    for step in range(8):
        replica.load_state_dict(model.state_dict())
        x, y = _batch(rank, step)
        replica.zero_grad()
        torch.nn.functional.cross_entropy(replica(x), y).backward()
        local = {n: gather_all(p.grad.detach().reshape(-1).clone(), ws) for n, p in replica.named_parameters()}
        opt.zero_grad()
        torch.nn.functional.cross_entropy(ddp(x), y).backward()
        got = {n: p.grad.detach().reshape(-1).clone() for n, p in model.named_parameters()}
        metrics.append(engine.last_step.compressor_metrics)
        sent2 = p2 = 0.0
        for g in engine.plan.groups:
            gs = [torch.cat([local[n][r] for n in g.names]) for r in range(ws)]
            got_flat = torch.cat([got[n] for n in g.names])
            ps = [gs[r] + mem.get((r, g.gid), 0) for r in range(ws)]
            basis = comp.bases.get(g.gid)
            if g.exact or step < 5:  # engine warm-up, gradiveq warm-up, 3 exact sample steps
                ref = sum(ps) / ws
                for r in range(ws):
                    mem[(r, g.gid)] = torch.zeros_like(ps[r])
            else:
                compressed += 1
                recon = []
                for q in ps:
                    out, off = torch.empty_like(q), 0
                    for n, shape in zip(g.names, [tuple(dict(model.named_parameters())[n].shape) for n in g.names]):
                        size = int(torch.Size(shape).numel())
                        seg = q[off:off + size]
                        L = next(L for L in basis.layers if L.name == n)
                        b = next(b for b in basis.blocks if b.layer == L.index)
                        F, D, P = shape[0], shape[1], int(torch.Size(shape[2:]).numel())
                        x = _ref_pack(seg, F, D, P, L.K)
                        mu = basis.mu[L.index]
                        out[off:off + size] = _ref_unpack((x - mu) @ b.U @ b.U.T + mu, F, D, P)
                        off += size
                    recon.append(out)
                ref = sum(recon) / ws
                ref_loss = sum(float((q - c).pow(2).sum() / q.pow(2).sum()) for q, c in zip(ps, recon)) / ws
                sent2 += sum(float(c.double().pow(2).sum()) for c in recon)
                p2 += sum(float(q.double().pow(2).sum()) for q in ps)
                for r in range(ws):
                    mem[(r, g.gid)] = ps[r] - recon[r]
                worst_mem = max(worst_mem, float((engine.memory[g.gid] - mem[(rank, g.gid)]).abs().max()))
            worst_grad = max(worst_grad, float((got_flat - ref).abs().max() / (ref.abs().max() + 1e-12)))
        if p2 > 0:  # compression gain E‖sent‖²/E‖p‖² over ranks, ‖sent‖² from the coefficients
            gains.append((engine.last_step.gain, sent2 / p2))
        opt.step()
    # the step's ratio over every compressed group, closed form: rows·d per compressed tensor (K by
    # the slice rule written out: conv 8x3x3x3 → F·D = 24 ≤ 64, m | 9, m ≤ 2 → K = 24; linear 5x128 →
    # F·D > 64, K = 5·m, m | 128, m ≤ 12 → K = 40) and 1 per element of an exact tensor (biases)
    ks = {"0.weight": 24, "3.weight": 40}
    numels = {n: p.numel() for n, p in model.named_parameters()}
    z = dense = 0
    for g in engine.plan.groups:
        if g.exact:
            continue
        for n in g.names:
            dense += numels[n]
            z += numels[n] // ks[n] * int(metrics[-1][f"gradiveq/d/{n}"]) if n in ks else numels[n]
    return {"grad": worst_grad, "mem": worst_mem, "compressed": compressed, "metrics": metrics, "loss": ref_loss,
            "gains": gains, "ratio_ref": z / dense, "lossy_groups": sum(not g.exact for g in engine.plan.groups)}


def test_engine_gradient_and_error_feedback_match_their_definitions(all_results):
    for r, res in enumerate(x["engine"] for x in all_results):
        assert res["compressed"] == 3, res["compressed"]
        assert res["grad"] <= 1e-5, f"rank {r}: gradient off by {res['grad']:.3g}"
        assert res["mem"] <= 1e-5, f"rank {r}: memory off by {res['mem']:.3g}"
        m = res["metrics"]
        assert m[0] is None and [x["gradiveq/phase"] for x in m[1:]] == [0.0, 1.0, 1.0, 1.0, 2.0, 2.0, 2.0]
        last = m[-1]
        assert last["gradiveq/ratio"] == pytest.approx(res["ratio_ref"], rel=1e-12), (res["lossy_groups"], last)
        assert res["ratio_ref"] < 1
        assert abs(last["gradiveq/loss"] - res["loss"]) <= 1e-5 * res["loss"]  # Eq. 7, mean over ranks
        assert len(res["gains"]) == 3 and all(abs(g - ref) <= 1e-5 * ref for g, ref in res["gains"]), res["gains"]
        assert 1 <= last["gradiveq/d/0.weight"] < 64 and 1 <= last["gradiveq/d/3.weight"] < 64


def test_checkpoint_state_restores_schedule_and_basis_exactly():
    """A basis fitted in process (world size 1 context), saved and loaded: same phases, same z."""
    cfg = GradiVeQConfig(max_slice=96, warmup=1, sample_steps=3, compress_steps=4, pca_slices=2)
    comp = GradiVeQCompressor(cfg)
    for step in range(4):
        assert comp.phase(step) == ("warmup" if step == 0 else "sample")
        if step:
            comp.add_sample(_grad(0, 1, step), _ctx(0, 1, step))
    assert comp.phase(4) == "compress"
    basis = comp.fit(_ctx(0, 1, 4), torch.float32)
    assert basis is not None
    # z per element: 3 rows·d (conv) + 5 rows·d (fc) + 12 exact values, of 780
    d = {b.layer: b.d for b in basis.blocks}
    assert comp.payload_fraction == pytest.approx((3 * d[0] + 5 * d[1] + 12) / 780, rel=1e-12)
    assert comp.payload_fraction < 1
    state = comp.state_dict()
    twin = GradiVeQCompressor(cfg)
    twin.load_state_dict(copy.deepcopy(state))
    assert not twin.needs_fit(0) and twin.bases[0].digest == basis.digest
    assert twin.payload_fraction == comp.payload_fraction  # survives the checkpoint
    x = _grad(1, 3, 9)
    assert torch.equal(twin.compress(x, _ctx(0, 3, 5)).payload[0], comp.compress(x, _ctx(0, 3, 5)).payload[0])
    assert [twin.phase(s) for s in range(5, 10)] == [comp.phase(s) for s in range(5, 10)]
    # saved mid-sample: the restored run samples afresh from its next step
    comp2 = GradiVeQCompressor(cfg)
    comp2.phase(0), comp2.phase(1), comp2.phase(2)
    twin2 = GradiVeQCompressor(cfg)
    twin2.load_state_dict(comp2.state_dict())
    assert [twin2.phase(s) for s in (3, 4, 5, 6)] == ["sample", "sample", "sample", "compress"]


def test_a_replaced_plan_drops_a_stale_basis_and_its_samples():
    cfg = GradiVeQConfig(max_slice=96, warmup=0, sample_steps=2, compress_steps=4, pca_slices=2)
    comp = GradiVeQCompressor(cfg)
    for step in range(2):
        comp.phase(step)
        comp.add_sample(_grad(0, 1, step), _ctx(0, 1, step))
    assert comp.phase(2) == "compress" and comp.fit(_ctx(0, 1, 2), torch.float32) is not None
    assert comp.basis_for(_ctx(0, 1, 3)) is not None
    other = GroupContext(step=3, rank=0, world_size=1, segments=(768, 12), shapes=((12, 64), (12,)))
    assert comp.basis_for(other) is None and 0 not in comp.bases
    comp.add_sample(torch.randn(780), other)  # statistics of another layout restart instead of failing
    assert comp.samples[0].count == 1


def _ef_warnings(rank: int, world_size: int, tmp: str) -> list[bool]:
    import warnings

    import lightning as L
    from lit_models import TinyClassifier, make_loader

    def warned(ef: bool | None) -> bool:
        trainer = L.Trainer(strategy=GCStrategy(compressor="gradiveq", error_feedback=ef), accelerator="cpu",
                            devices=1, logger=False, enable_progress_bar=False, enable_model_summary=False,
                            enable_checkpointing=False, max_steps=1, default_root_dir=tmp)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            trainer.fit(TinyClassifier(), make_loader(n=32))
        return any("gradiveq" in str(w.message) and "error_feedback=True" in str(w.message) for w in caught)

    return [warned(True), warned(False), warned(None)]


def test_error_feedback_warns_at_setup(tmp_path):
    """error_feedback=True warns (measured to diverge); the default (off) and False do not."""
    (result,) = run_distributed(_ef_warnings, 1, str(tmp_path), timeout=180)
    assert result == [True, False, False]
