"""OMGS calibration agreed at 2, 3 and 4 ranks: the fits come from the element-wise MAX over ranks.

Each rank runs ``OMGSController.calibrate`` for real (the active exchange's collectives, the exact
group's allreduce, the per-step control collectives), but its group-job timings are replaced by
known, rank-dependent values: at size ``i`` the largest comes from rank ``i mod N``, and the maxima
lie exactly on Eq. 10 (``t_s = s0 + γ·ρ·D·ln D``) and Eq. 11 (``t_c = α + β·bytes``) with known
coefficients, while every other rank's value is off the line. So

* a wrong reduction (sum, mean, min, one rank's values) or a mis-indexed slice of the agreed vector
  moves the fitted γ, s0, α, β away from the known values;
* the exact-group and overhead timings (real, unknown) must equal the MAX of what each rank measured.

Oracle: the known coefficients, the per-size maxima computed here from all ranks' injected values,
the payload bytes of Top-k (``k`` fp32 values + ``k`` int32 indices, ``k = ⌈ρD⌉``) by hand.
"""

from __future__ import annotations

import math

import pytest
import torch
from dist_harness import run_distributed

RATIO = 0.05
S0, GAMMA = 2e-4, 3e-8  # Eq. 10: seconds, seconds per (element·ln element) per unit ratio
ALPHA, BETA = 5e-4, 2e-9  # Eq. 11: seconds, seconds per payload byte


def _payload(d: int) -> int:
    return 8 * math.ceil(RATIO * d)


def _injected(rank: int, ws: int, i: int, d: int) -> tuple[float, float]:
    """(t_s, t_c) this rank reports for size index i: on the lines for rank i mod ws, below otherwise."""
    ts = S0 + GAMMA * RATIO * d * math.log(d)
    tc = ALPHA + BETA * _payload(d)
    if rank == i % ws:
        return ts, tc
    f = 0.3 + 0.15 * ((rank + 2 * i) % 4)  # 0.3 .. 0.75 of the line, varying by rank and size
    return ts * f, tc * (1.05 - f)


def _calibrate(rank: int, ws: int) -> dict:
    from lightning_gc.compressors import build_compressor
    from lightning_gc.engine import EngineConfig, GCEngine
    from lightning_gc.engine.omgs import OMGSConfig, OMGSController

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Tanh(), torch.nn.Linear(64, 48))
    engine = GCEngine(build_compressor("topk", ratio=RATIO),
                      EngineConfig(plan="model", min_compress_numel=1024, warmup_steps=0),
                      list(model.named_parameters()))
    ctl = OMGSController(engine, OMGSConfig(calibration_sizes=4, calibration_repeats=2), model,
                         list(model.named_parameters()), "omgs")
    sizes = ctl.calibration_sizes()
    index = {d: i for i, d in enumerate(sizes)}
    real_job, real_agree = ctl._time_group_job, ctl._agree_max
    jobs, agreed_in = [], []

    def job(src, mem, out, ctx):
        real_job(src, mem, out, ctx)  # the exchange really runs on every rank
        jobs.append(src.numel())
        return _injected(rank, ws, index[src.numel()], src.numel())

    def agree_max(values):
        agreed_in.append(list(values))
        return real_agree(values)

    ctl._time_group_job, ctl._agree_max = job, agree_max
    cal = ctl.calibrate()
    out = {
        "sizes": sizes, "jobs": jobs, "local": agreed_in[0], "payload": cal.payload_bytes,
        "sparsify_s": cal.sparsify_s, "comm_s": cal.comm_s, "exact_s": cal.exact_s, "overhead_s": cal.overhead_s,
        "gamma": cal.sparsify.gamma_s, "s0": cal.sparsify.intercept_s, "alpha": cal.comm.intercept,
        "beta": cal.comm.slope, "payload_fit": (cal.payload.intercept, cal.payload.slope),
        "exact_numel": sum(g.numel for g in engine.plan.groups if g.exact),
    }
    ctl.detach()
    engine.close()
    return out


@pytest.mark.parametrize("ws", [2, 3, pytest.param(4, marks=pytest.mark.extended)])  # 4: 11 s, -m extended
def test_calibration_fits_the_max_over_ranks(ws):
    res = run_distributed(_calibrate, ws, timeout=280)
    sizes = res[0]["sizes"]
    k = len(sizes)
    assert k == 4 and all(r["sizes"] == sizes for r in res)
    # geometric sizes from min_compress_numel (1024) to the compressible total (64·64 + 64·48 = 7168)
    assert sizes[0] == 1024 and sizes[-1] == 7168
    assert sizes == sorted(round(1024 * 7 ** (i / 3)) for i in range(4))
    for r in res:  # one untimed + 2 timed runs per size, in size order
        assert r["jobs"] == [d for d in sizes for _ in range(3)]
        assert r["payload"] == [float(_payload(d)) for d in sizes]
        assert r["exact_numel"] == 64 + 48
    # the agreed medians are the per-size maxima of the injected values, the maxima come from
    # different ranks at different sizes, and every rank holds them
    want_s = [max(_injected(q, ws, i, d)[0] for q in range(ws)) for i, d in enumerate(sizes)]
    want_c = [max(_injected(q, ws, i, d)[1] for q in range(ws)) for i, d in enumerate(sizes)]
    for r in res:
        assert r["sparsify_s"] == pytest.approx(want_s, rel=1e-12)
        assert r["comm_s"] == pytest.approx(want_c, rel=1e-12)
        assert r["local"][:2 * k] == pytest.approx([_injected(res.index(r), ws, i, d)[0] for i, d in enumerate(sizes)]
                                                   + [_injected(res.index(r), ws, i, d)[1]
                                                      for i, d in enumerate(sizes)], rel=1e-12)
    # the real timings (exact allreduce, control collectives): the MAX of each rank's own
    for j, key in ((2 * k, "exact_s"), (2 * k + 1, "overhead_s")):
        want = max(r["local"][j] for r in res)
        assert all(r[key] == want for r in res), key
        assert want > 0
    # the fits recover the lines the maxima were put on
    for r in res:
        assert r["gamma"] == pytest.approx(GAMMA, rel=1e-9)
        assert r["s0"] == pytest.approx(S0, rel=1e-9)
        assert r["alpha"] == pytest.approx(ALPHA, rel=1e-9)
        assert r["beta"] == pytest.approx(BETA, rel=1e-9)
        assert r["payload_fit"] == res[0]["payload_fit"]
