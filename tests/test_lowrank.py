"""The low-rank (PowerSGD-family) compressor and exchange: oracles on spawned gloo ranks.

Oracles, none of them the code under test:

* the projection is computed by hand — Gram-Schmidt in float64 for ``P̂`` (not ``torch.linalg.qr``;
  a basis differs from QR's by column signs, which the projection ``P̂·P̂ᵀ`` does not see), the
  mean of every rank's matrix, ``P̂·P̂ᵀ·M̄`` for the aggregate and ``P̂·P̂ᵀ·M_r`` for what rank r
  sent; small tensors must arrive as the exact mean;
* warm-started power iteration on a fixed mean matrix must reach the best rank-r approximation
  (Eckart–Young: the truncated SVD's error), and the engine's gradient and error memory over
  several steps must follow the hand-written PowerSGD recursion from every rank's gradients;
* a matrix of rank ≤ r is reproduced exactly by the one-rank compress/decompress.

Rank-dependent inputs differ in size and direction, so a missing reduction or a rank that wins by
every measure shows.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
from dist_harness import gather_all, run_distributed
from torch.nn.parallel import DistributedDataParallel as DDP

from lightning_gc.comm import direct
from lightning_gc.comm.exchange import ExchangeTimes, LazySent, Timer
from lightning_gc.compressors import GroupContext, build_compressor
from lightning_gc.compressors.lowrank import LowRankConfig, plan_blocks, project, project_t
from lightning_gc.engine import EngineConfig, GCEngine, gc_comm_hook
from lightning_gc.exchanges.lowrank import LowRankExchange
from lightning_gc.exchanges.registry import make_exchange, validate_collective

RANK = 2
# a group: a 12×10 matrix (compressed), a bias, a 3×2 matrix (too small: dense), a 10×3×3 conv
# kernel (10×9, compressed), a 6×3×3 kernel (6×9: 54 < 2·15·2 = 60, dense)
SHAPES = [(12, 10), (7,), (3, 2), (10, 3, 3), (6, 3, 3)]
COMPRESSED = {0: (12, 10), 3: (10, 9)}
NAMES = tuple(f"t{i}" for i in range(len(SHAPES)))


def _numel(shape):
    return int(torch.Size(shape).numel())


def _gram_schmidt(p: torch.Tensor) -> torch.Tensor:
    """Orthonormal columns of ``p`` (float64, modified Gram-Schmidt)."""
    q = p.double().clone()
    for j in range(q.shape[1]):
        for i in range(j):
            q[:, j] -= (q[:, i] @ q[:, j]) * q[:, i]
        q[:, j] /= q[:, j].norm()
    return q


def _ctx(rank: int, ws: int, step: int = 0) -> GroupContext:
    return GroupContext(step=step, rank=rank, world_size=ws, segments=tuple(_numel(s) for s in SHAPES), seed=5,
                        shapes=tuple(SHAPES), names=NAMES)


def _grads(rank: int, step: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(100 * rank + step)
    return [torch.randn(s, generator=g) * (1.0, 2.5, 0.4)[(rank + step) % 3] for s in SHAPES]


def _q0(cols: int, salt: int) -> torch.Tensor:
    return torch.randn(cols, RANK, generator=torch.Generator().manual_seed(77 + salt))


def _exchange(rank: int, ws: int, warm_start: bool = True, dense_names: tuple[str, ...] = (),
              wire_dtype: str = "float32") -> LowRankExchange:
    comp = build_compressor("lowrank", args=dict(rank=RANK, warm_start=warm_start, dense_names=dense_names,
                                                 wire_dtype=wire_dtype))
    ex = make_exchange(comp, collective="lowrank")
    assert isinstance(ex, LowRankExchange)
    # the starting Q is set by the test, so the reference knows it
    ex.load_state_dict({"lowrank_q": {f"t{i}:{n}x{m}": _q0(m, i) for i, (n, m) in COMPRESSED.items()}})
    return ex


def _dense(sent) -> torch.Tensor:
    """The exchange's ``sent`` as a tensor (it returns a LazySent: built here, and checked against it)."""
    if not isinstance(sent, LazySent):
        return sent
    built = sent.materialise()
    want = float(built.double().square().sum())
    assert (math.isnan(want) and math.isnan(sent.sq_norm)) or math.isclose(sent.sq_norm, want, rel_tol=1e-5, abs_tol=1e-9), \
        f"LazySent.sq_norm {sent.sq_norm} is not ‖sent‖² {want}"
    target = torch.randn(built.shape, generator=torch.Generator().manual_seed(5))
    # subtract_from(t) writes t − sent in place
    torch.testing.assert_close(sent.subtract_from(target.clone()), target - built, rtol=1e-5, atol=1e-6, equal_nan=True)
    return built


def _run(ex, p, ctx):
    times = ExchangeTimes()
    mean, sent = ex.run(p, ctx, Timer(p.device, times))
    return mean, _dense(sent), times


def _exchange_scenarios(rank: int, ws: int) -> dict:
    out = {}
    # one step from a known Q, every rank's input gathered for the reference
    ex = _exchange(rank, ws)
    p = torch.cat([g.reshape(-1) for g in _grads(rank, 0)])
    mean, sent, times = _run(ex, p, _ctx(rank, ws))
    out["one"] = dict(p_all=gather_all(p, ws), mean=mean, sent=sent, bytes_payload=times.bytes_payload,
                      q=ex.state_dict()["lowrank_q"])
    # the same step with the 10×3×3 kernel (t3, compressed by the size rule) named dense
    mean, sent, times = _run(_exchange(rank, ws, dense_names=("t3",)), p, _ctx(rank, ws))
    out["named_dense"] = dict(mean=mean, sent=sent, bytes_payload=times.bytes_payload)
    # the same step in bfloat16 messages, with an exact group (rank-dependent, 5 values) in the P message
    exact = torch.randn(5, generator=torch.Generator().manual_seed(40 + rank)) * (3.0 if rank == 1 else 0.2)
    ex = _exchange(rank, ws, wire_dtype="bfloat16")
    times = ExchangeTimes()
    mean, sent, exact_mean = ex.run_with_exact(p, _ctx(rank, ws), Timer(p.device, times), exact)
    sent = _dense(sent)
    out["bf16"] = dict(mean=mean, sent=sent, exact_all=gather_all(exact, ws), exact_mean=exact_mean,
                       bytes_payload=times.bytes_payload, q=ex.state_dict()["lowrank_q"])
    # the closing report riding in the Q message: a share of 0/1 flags, a count and a float per rank
    out["ride"] = {}
    for wire in ("float32", "bfloat16"):
        seen = []

        def share(sent_now, r=rank, seen=seen):
            seen.append(sent_now.sq_norm)
            return torch.tensor([float(r == 1), 1.0, float(r + 1), 0.1 * (r + 1), 3.0 * r * r], dtype=torch.float32)

        ex, alone = _exchange(rank, ws, wire_dtype=wire), _exchange(rank, ws, wire_dtype=wire)
        times = ExchangeTimes()
        mean, sent, exact_mean, summed = ex.run_riding(p0 := torch.cat([g.reshape(-1) for g in _grads(rank, 0)]),
                                                       _ctx(rank, ws), Timer(p0.device, times), None, share)
        mean_alone, sent_alone, times_alone = _run(alone, p0, _ctx(rank, ws))
        sent = _dense(sent)
        out["ride"][wire] = dict(mean=mean, sent=sent, exact_mean=exact_mean, summed=summed, seen=seen[0],
                                 mean_alone=mean_alone, sent_alone=sent_alone, payload=times.bytes_payload,
                                 payload_alone=times_alone.bytes_payload, q=ex.state_dict()["lowrank_q"],
                                 q_alone=alone.state_dict()["lowrank_q"])
    # warm-started power iteration on a fixed mean: M_r = A + (r − (N−1)/2)·B, so M̄ = A exactly
    g = torch.Generator().manual_seed(3)
    u, _ = torch.linalg.qr(torch.randn(12, 10, generator=g))
    v, _ = torch.linalg.qr(torch.randn(10, 10, generator=g))
    a = u @ torch.diag(torch.tensor([10.0, 6.0, 1.0, 0.5, 0.3, 0.2, 0.1, 0.05, 0.02, 0.01])) @ v.t()
    b = torch.randn(12, 10, generator=g)
    mats = [a + (rank - (ws - 1) / 2) * b] + [torch.zeros(s) for s in SHAPES[1:]]
    p = torch.cat([m.reshape(-1) for m in mats])
    errors = {}
    for warm in (True, False):
        ex = _exchange(rank, ws, warm_start=warm)
        for step in range(20):
            mean, _, _ = _run(ex, p, _ctx(rank, ws, step))
        errors[warm] = float((mean[:120].view(12, 10) - a).norm())
    out["power"] = dict(a=a, errors=errors, warm_state=_exchange(rank, ws, True).state_dict(),
                        cold_state=_exchange(rank, ws, False).state_dict())
    # a non-finite input on one rank: every rank gets a non-finite mean, the warm start keeps the old Q
    ex = _exchange(rank, ws)
    before = ex.state_dict()["lowrank_q"]
    p = torch.cat([g.reshape(-1) for g in _grads(rank, 1)])
    if rank == ws - 1:
        p[5] = float("nan")
    mean, _, _ = _run(ex, p, _ctx(rank, ws, 1))
    out["nan"] = dict(finite=bool(torch.isfinite(mean).all()), kept=all(
        torch.equal(before[k], v) for k, v in ex.state_dict()["lowrank_q"].items()))
    return out


_RUNS: dict[int, list] = {}


@pytest.fixture(params=[2, 3], ids=lambda ws: f"ws{ws}")
def exchange_runs(request):
    if request.param not in _RUNS:
        _RUNS[request.param] = run_distributed(_exchange_scenarios, request.param, timeout=240)
    return _RUNS[request.param]


def _split(flat: torch.Tensor) -> list[torch.Tensor]:
    out, off = [], 0
    for s in SHAPES:
        out.append(flat[off:off + _numel(s)])
        off += _numel(s)
    return out


def test_one_step_is_the_projection_of_the_mean_onto_the_agreed_subspace(exchange_runs):
    ws = len(exchange_runs)
    one = exchange_runs[0]["one"]
    inputs = [_split(p) for p in one["p_all"]]
    want_bytes = 4 * (sum(_numel(s) for i, s in enumerate(SHAPES) if i not in COMPRESSED)
                      + sum((n + m) * RANK for n, m in COMPRESSED.values()))
    for r, res in enumerate(x["one"] for x in exchange_runs):
        assert torch.equal(res["mean"], one["mean"]), f"rank {r} got another mean"
        mean, sent = _split(res["mean"]), _split(res["sent"])
        assert res["bytes_payload"] == want_bytes
        for i in range(len(SHAPES)):
            ms = [inp[i].double() for inp in inputs]
            avg = sum(ms) / ws
            if i not in COMPRESSED:  # dense: the exact mean arrives, and this rank sent itself
                torch.testing.assert_close(mean[i].double(), avg, rtol=1e-6, atol=1e-7)
                assert torch.equal(sent[i], inputs[r][i])
                continue
            n, m = COMPRESSED[i]
            p_sum = sum(x.view(n, m) @ _q0(m, i).double() for x in ms)
            basis = _gram_schmidt(p_sum)
            proj = basis @ basis.t()
            torch.testing.assert_close(mean[i].double().view(n, m), proj @ avg.view(n, m), rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(sent[i].double().view(n, m), proj @ ms[r].view(n, m), rtol=1e-5, atol=1e-5)
            # the warm start keeps Q̄ = M̄ᵀ·P̂ (up to column signs: compare Q̄·Q̄ᵀ)
            q = res["q"][f"t{i}:{n}x{m}"].double()
            q_ref = avg.view(n, m).t() @ basis
            torch.testing.assert_close(q @ q.t(), q_ref @ q_ref.t(), rtol=1e-4, atol=1e-5)
        # conservation: the mean is the mean of what the ranks sent
    sents = [x["one"]["sent"].double() for x in exchange_runs]
    torch.testing.assert_close(sum(sents) / ws, one["mean"].double(), rtol=1e-5, atol=1e-6)


def _bf16(x: torch.Tensor) -> torch.Tensor:
    """``x`` (float32) rounded to bfloat16 and widened back."""
    return x.float().to(torch.bfloat16).float()


def test_bfloat16_messages_carry_the_rounded_contributions_and_sent_is_what_was_rounded(exchange_runs):
    """``wire_dtype="bfloat16"``: each rank divides by N, rounds to bfloat16 and the backend sums.
    The oracle rounds every rank's contribution by hand (float32 → bfloat16, not the library's code):
    at 2 ranks one addition, so the arriving sum is exactly ``bf16(a + b)``; at 3 ranks the order of
    gloo's additions is not fixed, so the bound is three bfloat16 roundings of the absolute sum.
    ``sent`` must be this rank's *rounded* contribution (times N): error feedback keeps the rounding;
    an unrounded ``sent`` is off by up to 2⁻⁹ relative, far above the tolerance at 2 ranks."""
    ws = len(exchange_runs)
    inputs = [_split(p) for p in exchange_runs[0]["one"]["p_all"]]
    bf = exchange_runs[0]["bf16"]
    want_bytes = 2 * (5 + sum(_numel(s) for i, s in enumerate(SHAPES) if i not in COMPRESSED)
                      + sum((n + m) * RANK for n, m in COMPRESSED.values()))

    def arrives(parts: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """The bfloat16 sum of the ranks' rounded parts (exact at 2 ranks) and its error bound."""
        rounded = [_bf16(x / ws) for x in parts]
        total = _bf16(rounded[0] + rounded[1]) if ws == 2 else sum(x.double() for x in rounded).float()
        slack = 0.0 if ws == 2 else 3 * 2.0 ** -8 * sum(x.abs() for x in rounded)
        return total, slack

    def close(got: torch.Tensor, want: torch.Tensor, slack, tight: float = 1e-6) -> None:
        bound = tight * (1 + want.abs()) + slack
        assert bool(((got.double() - want.double()).abs() <= bound).all()), (got, want)

    ex_want, ex_slack = arrives(list(bf["exact_all"]))
    for r, x in enumerate(exchange_runs):
        res = x["bf16"]
        assert res["bytes_payload"] == want_bytes
        assert torch.equal(res["mean"], bf["mean"]) and torch.equal(res["exact_mean"], bf["exact_mean"])
        close(res["exact_mean"], ex_want, ex_slack)
        mean, sent = _split(res["mean"]), _split(res["sent"])
        for i in range(len(SHAPES)):
            ms = [inp[i].float() for inp in inputs]
            if i not in COMPRESSED:
                want, slack = arrives(ms)
                close(mean[i], want, slack)
                torch.testing.assert_close(sent[i], _bf16(ms[r] / ws) * ws, rtol=0, atol=0)
                continue
            n, m = COMPRESSED[i]
            p_sum, p_slack = arrives([x.view(n, m) @ _q0(m, i) for x in ms])
            if ws == 2:
                basis = _gram_schmidt(p_sum)
            else:  # the 3-rank sum is known to a few roundings: any basis close to it
                basis = _gram_schmidt(sum(x.view(n, m).double() @ _q0(m, i).double() for x in ms))
            qs = [x.view(n, m).t().double() @ basis for x in ms]
            q_mean, q_slack = arrives([q.float() for q in qs])
            tol = 1e-4 if ws == 2 else 3e-2
            torch.testing.assert_close(mean[i].double().view(n, m), basis @ q_mean.double().t(),
                                       rtol=tol, atol=tol)
            own = _bf16(qs[r].float() / ws).double() * ws  # this rank's rounded Q
            torch.testing.assert_close(sent[i].double().view(n, m), basis @ own.t(), rtol=tol, atol=tol)
            if ws == 2:  # the unrounded Q is measurably not what was sent
                assert float((basis @ qs[r].t() - sent[i].double().view(n, m)).abs().max()) > 10 * tol
    # against the fp32 messages: the same method, to bfloat16's precision
    torch.testing.assert_close(bf["mean"], exchange_runs[0]["one"]["mean"], rtol=0.05, atol=0.05)


@pytest.mark.parametrize("wire", ["float32", "bfloat16"])
def test_the_closing_report_rides_in_the_q_message_summed_and_not_divided(exchange_runs, wire):
    """``run_riding``: the report's share is appended to the ``Q`` allreduce, summed over the ranks and
    not divided by N, in the message's dtype. The oracle adds the shares by hand: the flags and
    counts arrive exactly (small integers, exact in bfloat16 too), the float within the dtype's
    rounding. The gradient part is the exchange without the report: the same mean, ``sent`` and
    warm start (bit for bit at 2 ranks, where each sum is one addition; to rounding at 3, where the
    longer message may change gloo's order of additions), and the same payload bytes (the report's
    elements are not payload). ``sent`` is computed before the message and handed to the share."""
    ws = len(exchange_runs)
    runs = [x["ride"][wire] for x in exchange_runs]
    want = torch.tensor([1.0, ws, sum(r + 1 for r in range(ws)), sum(0.1 * (r + 1) for r in range(ws)),
                         sum(3.0 * r * r for r in range(ws))], dtype=torch.float64)
    ftol = 2 ** -7 if wire == "bfloat16" else 1e-6
    for r, res in enumerate(runs):
        got = res["summed"].double()
        assert got.dtype == torch.float64 and res["summed"].dtype == torch.float32
        assert torch.equal(got[[0, 1, 2, 4]], want[[0, 1, 2, 4]]), (r, got)
        assert abs(float(got[3]) / float(want[3]) - 1) <= ws * ftol, (r, got)
        assert torch.equal(res["summed"], runs[0]["summed"])  # identical on every rank
        assert res["exact_mean"] is None
        assert abs(res["seen"] / float(res["sent"].double().square().sum()) - 1) < 1e-5  # ‖sent‖², before the message
        assert res["payload"] == res["payload_alone"]
        if ws == 2:
            assert torch.equal(res["mean"], res["mean_alone"]) and torch.equal(res["sent"], res["sent_alone"])
            assert all(torch.equal(res["q"][k], res["q_alone"][k]) for k in res["q_alone"])
        else:
            tol = dict(rtol=1e-2, atol=1e-2) if wire == "bfloat16" else dict(rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(res["mean"], res["mean_alone"], **tol)
            torch.testing.assert_close(res["sent"], res["sent_alone"], **tol)


def test_wire_dtype_is_validated_and_halves_the_one_rank_payload():
    with pytest.raises(ValueError, match="wire_dtype='float16' is invalid.*bfloat16"):
        LowRankConfig(wire_dtype="float16")
    g = torch.Generator().manual_seed(6)
    x = torch.cat([torch.randn(s, generator=g).reshape(-1) for s in SHAPES])
    ctx = _ctx(0, 1)
    c32 = build_compressor("lowrank", args=dict(rank=RANK)).compress(x, ctx)
    comp16 = build_compressor("lowrank", args=dict(rank=RANK, wire_dtype="bfloat16"))
    c16 = comp16.compress(x, ctx)
    assert c16.nbytes * 2 == c32.nbytes == 4 * (13 + 54 + (12 + 10) * 2 + (10 + 9) * 2)
    assert comp16.wire_element_size == 2 and "wire=bfloat16" in comp16.describe()
    y = comp16.decompress(c16.payload, c16.meta, ctx)
    assert y.dtype == x.dtype
    torch.testing.assert_close(y[120:133], _bf16(x[120:133]), rtol=0, atol=0)  # the dense tensors, rounded


def test_a_matrix_named_in_dense_names_arrives_as_the_exact_mean(exchange_runs):
    """dense_names=("t3",): the kernel the size rule compresses travels dense instead — the exact
    mean arrives and each rank sent itself (no error memory) — while t0 is still projected exactly
    as without the option; the bytes grow by t3's values less its factors."""
    ws = len(exchange_runs)
    inputs = [_split(p) for p in exchange_runs[0]["one"]["p_all"]]
    want_bytes = 4 * (sum(_numel(s) for i, s in enumerate(SHAPES) if i != 0) + (12 + 10) * RANK)
    for r, x in enumerate(exchange_runs):
        got, plain = x["named_dense"], x["one"]
        assert got["bytes_payload"] == want_bytes
        mean, sent = _split(got["mean"]), _split(got["sent"])
        avg3 = sum(inp[3].double() for inp in inputs) / ws
        torch.testing.assert_close(mean[3].double(), avg3, rtol=1e-6, atol=1e-7)
        assert torch.equal(sent[3], inputs[r][3])
        # t0 as without the option (not bit for bit: the allreduce's buffer, hence gloo's chunking, changed)
        torch.testing.assert_close(mean[0], _split(plain["mean"])[0], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(sent[0], _split(plain["sent"])[0], rtol=1e-5, atol=1e-6)


def test_dense_names_match_parameter_names_and_are_validated():
    cfg = LowRankConfig(rank=RANK, dense_names=["t*3", "other"])  # a YAML list is kept as a tuple
    assert cfg.dense_names == ("t*3", "other")
    segs, shapes = tuple(_numel(s) for s in SHAPES), tuple(SHAPES)
    assert [b.compressed for b in plan_blocks(segs, shapes, cfg, NAMES)] == [True, False, False, False, False]
    assert [b.compressed for b in plan_blocks(segs, shapes, cfg)] == [True, False, False, True, False]  # no names
    assert LowRankConfig(dense_names="t3").dense_names == ("t3",)  # a string is one pattern
    for bad in ([""], [3], 3, ""):
        with pytest.raises(ValueError, match="dense_names=.* is invalid"):
            LowRankConfig(dense_names=bad)


def test_warm_started_power_iteration_reaches_the_best_rank_r_approximation(exchange_runs):
    """Eckart–Young: no rank-2 matrix is closer to M̄ than its truncated SVD, whose error is
    √(Σ_{i>2} σᵢ²). Warm start converges to it; a fresh Q each step does not."""
    res = exchange_runs[0]["power"]
    s = torch.linalg.svdvals(res["a"].double())
    best = float(s[RANK:].pow(2).sum().sqrt())
    assert res["errors"][True] == pytest.approx(best, rel=1e-3)
    assert res["errors"][False] > 1.05 * best
    assert all(x["power"]["errors"] == res["errors"] for x in exchange_runs)
    assert res["warm_state"]["lowrank_q"] and res["cold_state"] == {}  # no state without warm start


def test_a_non_finite_input_reaches_every_rank_and_keeps_the_warm_start(exchange_runs):
    for x in exchange_runs:
        assert x["nan"] == {"finite": False, "kept": True}


def test_which_tensors_are_compressed_follows_the_size_rule():
    blocks = plan_blocks(tuple(_numel(s) for s in SHAPES), tuple(SHAPES), LowRankConfig(rank=RANK))
    assert [(b.rows, b.cols) for b in blocks] == [(12, 10), (0, 0), (0, 0), (10, 9), (0, 0)]
    assert [b.offset for b in blocks] == [0, 120, 127, 133, 223]
    # rate 1: compress whenever (n+m)·r ≤ n·m — the 6×9 kernel now too
    loose = plan_blocks(tuple(_numel(s) for s in SHAPES), tuple(SHAPES), LowRankConfig(rank=RANK, min_compression_rate=1))
    assert [b.compressed for b in loose] == [True, False, False, True, True]
    # rank ≥ min(n, m): never compressed; no shapes: all dense
    assert not plan_blocks((12,), ((3, 4),), LowRankConfig(rank=3))[0].compressed
    assert not any(b.compressed for b in plan_blocks((120,), (), LowRankConfig()))


@pytest.mark.parametrize("r", [1, 2, 8, 9, 20])
def test_the_thin_products_are_the_products_on_both_paths(r):
    """project / project_t take a short-wide form up to SHORT_WIDE_MAX_RANK columns and torch's
    own above; either way the values are m·q and mᵀ·p. Oracle: the sums written out by
    broadcasting in float64 (no matrix product). Inputs are views (a column slice, a transpose),
    as the exchange's are."""
    g = torch.Generator().manual_seed(r)
    m = torch.randn(40, 70, generator=g)[:, 5:66]  # 40 × 61, not contiguous
    q = torch.randn(r, 61, generator=g).t()  # 61 × r, a transposed view
    p = torch.randn(40, r, generator=g)
    want_p = (m.double()[:, :, None] * q.double()[None, :, :]).sum(1)
    want_q = (m.double()[:, :, None] * p.double()[:, None, :]).sum(0)
    got_p, got_q = project(m, q), project_t(m, p)
    assert got_p.shape == (40, r) and got_q.shape == (61, r)
    torch.testing.assert_close(got_p.double(), want_p, rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(got_q.double(), want_q, rtol=1e-5, atol=1e-4)


def test_one_rank_compress_reproduces_a_matrix_of_rank_at_most_r():
    comp = build_compressor("lowrank", args=dict(rank=RANK))
    g = torch.Generator().manual_seed(1)
    low = torch.randn(12, 2, generator=g) @ torch.randn(2, 10, generator=g)  # rank 2
    parts = [low] + [torch.randn(s, generator=g) for s in SHAPES[1:]]
    x = torch.cat([t.reshape(-1) for t in parts])
    ctx = _ctx(0, 1)
    c = comp.compress(x, ctx)
    y = comp.decompress(c.payload, c.meta, ctx)
    torch.testing.assert_close(y[:120], x[:120], rtol=1e-5, atol=1e-5)  # rank 2 kept whole
    torch.testing.assert_close(y[120:133], x[120:133])  # dense tensors exact
    conv = x[133:223].view(10, 9)
    assert float((y[133:223].view(10, 9) - conv).norm()) > 0.1 * float(conv.norm())  # full rank: lossy
    assert c.nbytes == 4 * (13 + 54 + (12 + 10) * 2 + (10 + 9) * 2)


def _with_spectrum(rows: int, cols: int, sv: list[float], g: torch.Generator) -> torch.Tensor:
    u, _ = torch.linalg.qr(torch.randn(rows, len(sv), generator=g))
    v, _ = torch.linalg.qr(torch.randn(cols, len(sv), generator=g))
    return u @ torch.diag(torch.tensor(sv)) @ v.t()


def test_warm_compress_is_the_warm_started_iteration_and_tends_to_the_best_rank_r_error():
    """The oracle: a matrix built with known singular values, whose best rank-2 error is
    Σ_{i>2} s_i² / Σ s_i² (Eckart–Young), and the dense tensors of the group sent exactly."""
    comp = build_compressor("lowrank", args=dict(rank=RANK))
    g = torch.Generator().manual_seed(3)
    sv12, sv10 = [10.0, 8.0, 5.0, 4.0, 3.0, 2.0, 1.0], [9.0, 6.0, 4.0, 3.0, 1.0]
    parts = [_with_spectrum(12, 10, sv12, g), torch.randn(7, generator=g), torch.randn(3, 2, generator=g),
             _with_spectrum(10, 9, sv10, g).reshape(10, 3, 3), torch.randn(6, 3, 3, generator=g)]
    x = torch.cat([t.reshape(-1) for t in parts])
    ctx = _ctx(0, 1)

    def err(c):
        y = comp.decompress(c.payload, c.meta, ctx)
        return float((y - x).pow(2).sum() / x.pow(2).sum())

    best = (sum(s * s for s in sv12[2:]) + sum(s * s for s in sv10[2:])) / float(x.pow(2).sum())
    cold, warm2, warm30 = err(comp.compress(x, ctx)), err(comp.warm_compress(x, ctx, 2)), err(comp.warm_compress(x, ctx, 30))
    assert err(comp.warm_compress(x, ctx, 1)) == cold  # one step is the cold start
    assert best < warm2 < cold
    assert warm30 == pytest.approx(best, rel=1e-4)
    with pytest.raises(ValueError, match=r"steps must be an integer >= 1"):
        comp.warm_compress(x, ctx, 0)


def test_auto_measures_lowrank_after_one_warm_step():
    from lightning_gc.auto.candidates import WARM_STEPS, candidate, measure_method

    assert WARM_STEPS == 2
    g = torch.Generator().manual_seed(4)
    x = torch.cat([_with_spectrum(12, 10, [10.0, 8.0, 5.0, 4.0, 3.0], g).reshape(-1)]
                  + [torch.randn(s, generator=g).reshape(-1) for s in SHAPES[1:]])
    ctx = _ctx(0, 1)
    comp = build_compressor("lowrank", args=dict(rank=RANK))
    c = comp.warm_compress(x, ctx, 2)
    want = float((comp.decompress(c.payload, c.meta, ctx) - x).pow(2).sum() / x.pow(2).sum())
    cold = comp.compress(x, ctx)
    cold_err = float((comp.decompress(cold.payload, cold.meta, ctx) - x).pow(2).sum() / x.pow(2).sum())
    got = measure_method(candidate("lowrank"), x, ctx, world_size=2, repeats=1).delta2
    assert got == pytest.approx(want, rel=1e-6) and got < cold_err


@pytest.mark.parametrize("kwargs, match", [
    (dict(rank=0), "rank=0 is invalid"),
    (dict(rank=1.5), "rank=1.5 is invalid"),
    (dict(min_compression_rate=0.5), "min_compression_rate=0.5 is invalid"),
    (dict(warm_start="yes"), "warm_start='yes'"),
])
def test_config_refuses_bad_values(kwargs, match):
    with pytest.raises(ValueError, match=match):
        LowRankConfig(**kwargs)


def test_only_its_own_exchange_carries_it():
    comp = build_compressor("lowrank")
    assert validate_collective(comp, "auto") == "lowrank"
    with pytest.raises(ValueError, match="lowrank"):
        validate_collective(comp, "allgather")
    with pytest.raises(ValueError, match="needs compressor='lowrank'"):
        LowRankExchange(build_compressor("topk", ratio=0.1))


# ---------------------------------------------------------------- inside the engine, with error feedback
class _Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a = torch.nn.Linear(20, 16)  # weight 16×20: compressed at rank 2; bias dense
        self.b = torch.nn.Linear(16, 3)  # weight 3×16: 48 < 2·19·2, dense

    def forward(self, x):
        return self.b(torch.tanh(self.a(x)))


def _engine_run(rank: int, ws: int, min_compress_numel: int = 0, report_rides: bool = True) -> dict:
    import torch.distributed as dist

    model = _Net()
    replica = copy.deepcopy(model)
    ddp = DDP(model, bucket_cap_mb=25)
    engine = GCEngine(build_compressor("lowrank", args=dict(rank=RANK)),
                      EngineConfig(warmup_steps=0, min_compress_numel=min_compress_numel, seed=3,
                                   report_rides=report_rides),
                      list(model.named_parameters()))
    lossy = {n for grp in engine.plan.groups if not grp.exact for n in grp.names}
    calls = []  # allreduces on the engine's own group, per step: the backend's ring or the direct exchange
    real_all_reduce, real_direct = dist.all_reduce, direct.direct_allreduce

    def counting(tensor, *args, group=None, **kwargs):
        if group is engine.exchange_group:
            calls[-1] += 1
        return real_all_reduce(tensor, *args, group=group, **kwargs)

    def counting_direct(tensor, group=None, op="sum"):
        if group is engine.exchange_group:
            calls[-1] += 1
        return real_direct(tensor, group, op)

    dist.all_reduce, direct.direct_allreduce = counting, counting_direct
    q0 = torch.randn(20, RANK, generator=torch.Generator().manual_seed(9))
    engine.exchange.load_state_dict({"lowrank_q": {"a.weight:16x20": q0}})
    ddp.register_comm_hook(engine, gc_comm_hook)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    names = [n for n, _ in model.named_parameters()]
    mem = {n: [torch.zeros_like(p, dtype=torch.float64) for _ in range(ws)] for n, p in model.named_parameters()}
    q = q0.double()
    worst_grad = worst_mem = worst_gain = 0.0
    for step in range(6):
        calls.append(0)
        replica.load_state_dict(model.state_dict())
        g = torch.Generator().manual_seed(10 * rank + step)
        x, y = torch.randn(8, 20, generator=g) * (1 + rank), torch.randint(0, 3, (8,), generator=g)
        replica.zero_grad()
        torch.nn.functional.cross_entropy(replica(x), y).backward()
        local = {n: gather_all(p.grad.detach().clone(), ws) for n, p in replica.named_parameters()}
        opt.zero_grad()
        torch.nn.functional.cross_entropy(ddp(x), y).backward()
        sent2 = p2 = 0.0  # the compression gain over all ranks: Σ‖sent‖² / Σ‖p‖² of the lossy groups
        for n in names:  # the hand-written PowerSGD recursion with error feedback
            ps = [local[n][r].double() + mem[n][r] for r in range(ws)]
            if n == "a.weight":
                basis = _gram_schmidt(sum(m @ q for m in ps))
                proj = basis @ basis.t()
                ref = proj @ (sum(ps) / ws)
                sents = [proj @ m for m in ps]
                mem[n] = [m - s for m, s in zip(ps, sents)]
                q = (sum(ps) / ws).t() @ basis
            else:
                ref = sum(ps) / ws
                sents = ps
            if n in lossy:
                sent2 += sum(float(s.square().sum()) for s in sents)
                p2 += sum(float(m.square().sum()) for m in ps)
            got = dict(model.named_parameters())[n].grad.double()
            worst_grad = max(worst_grad, float((got - ref).abs().max() / ref.abs().max()))
        for grp in engine.plan.groups:
            if grp.exact:  # sent exactly: no error memory at all
                assert grp.gid not in engine.memory
                continue
            want = torch.cat([mem[n][rank].reshape(-1) for n in grp.names])
            worst_mem = max(worst_mem, float((engine.memory[grp.gid].double().reshape(-1) - want).abs().max()))
        engine.before_optimizer_step()
        worst_gain = max(worst_gain, abs(engine.last_step.gain / (sent2 / p2) - 1))
        opt.step()
        engine.after_optimizer_step()
    dist.all_reduce, direct.direct_allreduce = real_all_reduce, real_direct
    return {"grad": worst_grad, "mem": worst_mem, "mem_norm": float(mem["a.weight"][rank].norm()), "gain": worst_gain,
            "params": torch.cat([p.detach().reshape(-1) for p in model.parameters()]),
            "groups": [(g.names, g.exact) for g in engine.plan.groups], "calls": calls}


@pytest.mark.parametrize("min_compress_numel,report_rides", [(0, True), (64, True), (64, False)],
                         ids=["no_exact_group", "exact_group_rides", "report_alone"])
def test_engine_gradient_and_error_memory_follow_powersgd_from_all_ranks(min_compress_numel, report_rides):
    """With ``min_compress_numel=64`` the bias of ``a`` and all of ``b`` form the plan's exact group,
    which travels in the ``P`` allreduce (``carries_exact``), and the closing report rides in the
    ``Q`` allreduce (``carries_report``): every step issues the ``P`` and ``Q`` allreduces, two in
    all, where a separate exact group and report would add one each (``report_rides=False``: three);
    the values still follow the exact mean (the oracle's ``sum(ps) / ws``), and the step's
    compression gain, summed in the ``Q`` message, the oracle's Σ‖sent‖² / Σ‖p‖² over both ranks."""
    results = run_distributed(_engine_run, 2, min_compress_numel, report_rides, timeout=240)
    for r, res in enumerate(results):
        assert res["grad"] <= 1e-4, f"rank {r}: gradient off by {res['grad']:.3g}"
        assert res["mem"] <= 1e-5, f"rank {r}: error memory off by {res['mem']:.3g}"
        assert res["mem_norm"] > 1e-3  # the compression really dropped something
        assert res["gain"] <= 1e-5, f"rank {r}: gain off by {res['gain']:.3g}"
    assert torch.equal(results[0]["params"], results[1]["params"])
    groups = results[0]["groups"]
    if min_compress_numel:
        assert groups == [(("a.weight",), False), (("b.bias", "b.weight", "a.bias"), True)]
    else:
        assert groups == [(("b.bias", "b.weight", "a.bias", "a.weight"), False)]
    # step 0 adds the opening check (check_every, an all-gather: not counted); P, Q (and the report alone)
    assert results[0]["calls"] == [2 if report_rides else 3] * 6, results[0]["calls"]
