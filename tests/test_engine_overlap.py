"""Engine v2: the overlapped engine against the synchronous one, and its safety nets.

* Stress: ``plan="layer"`` on a 20-tensor model, 3 spawned gloo ranks, 6 steps (12 for GradiVeQ, to reach each of its phases), every compressor
  with every collective it can travel by. Each rank trains two replicas on the same rank-dependent
  data, one with ``overlap=True`` (exchanges on the worker thread) and one with ``overlap=False``
  (exchanges inside the hook). After every step the gradients must be bit-identical between the
  two, and parameters identical across ranks. The exchanges must really have run on the worker
  thread (recorded thread ids), not on the hook's.
* Fail fast (``check_every=1``): ranks about to issue different exchange sequences (a ratio changed behind the
  engine's back on one rank; a step counter that differs) raise a clear error on every rank
  within seconds instead of hanging or aborting in C++.
* set_ratio: a rank-dependent ratio is refused on every rank; an agreed one changes k from the next
  step on.
* Setup signature: a rank-dependent compressor option is detected when the engine is built.
"""

from __future__ import annotations

import dataclasses
import threading
import time

import pytest
import torch
import torch.distributed as dist
from dist_harness import run_distributed
from torch.nn.parallel import DistributedDataParallel as DDP

from lightning_gc.compressors import available_compressors, build_compressor, takes_ratio
from lightning_gc.engine import EngineConfig, GCEngine, gc_comm_hook
from lightning_gc.exchanges.registry import compatible_collectives

STEPS = 12  # GradiVeQ's pairs: 12 steps reach every phase: it warms up (0-1), samples (2-4), compresses (5-9)
# and starts its second sample phase (10-11)
OTHER_STEPS = 6  # every other pair: one dense warm-up step, then 5 compressed ones (each step of all pairs
# costs ~4 s of the suite on 2 cores, 3 ranks)


def _steps(name: str) -> int:
    return STEPS if name == "gradiveq" else OTHER_STEPS
GQ_WARMUP = 2  # GradiVeQ's own exact warm-up (steps 0-1), then sample / compress phases
LAYERS = 10  # 10 Linear layers = 20 parameter tensors, 20 groups under plan="layer" (20 layers cost 62 s)


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    layers = []
    for _ in range(LAYERS):
        layers += [torch.nn.Linear(16, 16), torch.nn.Tanh()]
    return torch.nn.Sequential(*layers)


def _batch(rank: int, step: int):
    g = torch.Generator().manual_seed(7919 * rank + step)
    # rank-dependent data whose scale does not grow with the rank: no rank dominates every measure
    scale = (1.0, 0.3, 2.0, 0.7)[rank % 4]
    x = torch.randn(8, 16, generator=g) * scale
    y = torch.randn(8, 16, generator=g)
    return x, y


def _bitwise_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal bit for bit (NaN included: the SSDM cascade foil diverges by design, identically)."""
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(torch.int32), b.view(torch.int32))


def _pairs() -> list[tuple[str, str]]:
    """Every compressor at least once, every collective at least once, and every collective of the
    summable (randomk) and AR-Topk (star_topk) formats with a lossy compressor. The full cross
    product adds only dense/fp16/bf16 over ring/tree and var_topk over the other reductions, whose
    exchange code is the same as a pair already here."""
    extra = {"randomk": None, "star_topk": None}  # None: all their collectives
    out = []
    for name in available_compressors():
        colls = compatible_collectives(build_compressor(name))
        if name not in extra:
            colls = [colls[len(out) % len(colls)]]
        out.extend((name, c) for c in colls)
    covered = {c for _, c in out}
    for name in available_compressors():  # any collective still missing
        for c in compatible_collectives(build_compressor(name)):
            if c not in covered:
                out.append((name, c))
                covered.add(c)
    return out


def _engine(model, name: str, coll: str, overlap: bool, min_numel: int = 0,
            network: tuple[float, float] = (1e-4, 8e-8)) -> GCEngine:
    """``network``: the model's (α s, β s/byte); the default makes ``auto_sparse`` pick allgather for
    these small groups, (1e-6, 1e-6) makes it pick ART-Ring."""
    # GradiVeQ with a short schedule, so that STEPS steps reach its sample and compressed phases
    args = {"warmup": GQ_WARMUP, "sample_steps": 3, "compress_steps": 5, "max_slice": 256, "pca_slices": 4} \
        if name == "gradiveq" else None
    comp = build_compressor(name, ratio=0.25 if takes_ratio(name) else None, args=args)
    cfg = EngineConfig(plan="layer", min_compress_numel=min_numel, warmup_steps=1, seed=3, collective=coll,
                       overlap=overlap, network_alpha_s=network[0], network_beta_s_per_byte=network[1])
    return GCEngine(comp, cfg, list(model.named_parameters()))


def train_replicas(rank: int, ws: int, name: str, models, ddps, engines, device="cpu") -> tuple[list, list]:
    """Train the overlapped replica (``engines[0]``) and the synchronous one side by side on this
    rank's data; returns the steps whose gradients differ between them (bit for bit) and the steps
    after which the parameters differ across ranks. Shared with the CUDA tests (tests/test_cuda.py)."""
    opts = [torch.optim.SGD(m.parameters(), lr=0.05) for m in models]
    mismatch, diverged = [], []
    for step in range(_steps(name)):
        x, y = (t.to(device) for t in _batch(rank, step))
        for d, o in zip(ddps, opts):
            o.zero_grad()
            torch.nn.functional.mse_loss(d(x), y).backward()
        for e in engines:
            e.before_optimizer_step()
        for (na, a), b in zip(models[0].named_parameters(), models[1].parameters()):
            if not _bitwise_equal(a.grad, b.grad):  # bitwise: a diverging method's NaNs must match too
                mismatch.append((step, na, float((a.grad - b.grad).abs().max())))
        for o in opts:
            o.step()
        flat = torch.cat([p.detach().reshape(-1) for p in models[0].parameters()])
        gathered = [torch.empty_like(flat) for _ in range(ws)]
        dist.all_gather(gathered, flat)
        if not all(_bitwise_equal(flat, g) for g in gathered):
            diverged.append(step)
    return mismatch, diverged


def _stress(rank: int, ws: int, pairs) -> dict:
    out = {}
    for name, coll in pairs:
        t0 = time.perf_counter()
        models = [_model(), _model()]
        ddps = [DDP(m, bucket_cap_mb=0.002) for m in models]  # several buckets: groups span buckets
        engines = [_engine(m, name, coll, overlap) for m, overlap in zip(models, (True, False))]
        threads: list[set[int]] = [set(), set()]
        for eng, seen in zip(engines, threads):
            run = eng.exchange.run

            def traced(p, ctx, timer, _run=run, _seen=seen):
                _seen.add(threading.get_ident())
                return _run(p, ctx, timer)

            eng.exchange.run = traced
        for d, e in zip(ddps, engines):
            d.register_comm_hook(e, gc_comm_hook)
        mismatch, diverged = train_replicas(rank, ws, name, models, ddps, engines)
        totals = [e.totals() for e in engines]
        main = threading.get_ident()
        out[f"{name}/{coll}"] = {
            "mismatch": mismatch[:3], "diverged": diverged[:3],
            "compressed": [t["compressed_steps"] for t in totals],
            "sample": [t["sample_steps"] for t in totals],
            "bytes": [t["bytes_sent"] for t in totals],
            "worker_only": bool(threads[0]) and main not in threads[0],
            "inline_only": threads[1] == {main} or name == "dense",
            "seconds": time.perf_counter() - t0,
        }
        for e in engines:
            e.close()
    return out


PAIRS = _pairs()


def test_pairs_cover_every_compressor_and_collective():
    names = {n for n, _ in PAIRS}
    colls = {c for _, c in PAIRS}
    assert names == set(available_compressors())
    assert {"allreduce", "ring", "tree", "allgather", "art_allreduce", "art_ring", "art_tree", "auto_sparse"} <= colls


@pytest.mark.slow
@pytest.mark.timeout(1500)
def test_overlapped_engine_equals_synchronous_engine_under_stress():
    results = run_distributed(_stress, 3, PAIRS, timeout=1400)
    for key in results[0]:
        for r, res in enumerate(results):
            got = res[key]
            assert not got["mismatch"], f"{key} rank {r}: overlapped != synchronous at {got['mismatch']}"
            assert not got["diverged"], f"{key} rank {r}: ranks diverged at steps {got['diverged']}"
            assert got["compressed"][0] == got["compressed"][1]
            assert got["bytes"][0] == got["bytes"][1], f"{key}: different bytes {got['bytes']}"
            if key.startswith("gradiveq/"):  # after its own warm-up (dense), sample or compressed steps
                # both phases, and back into sampling (a second basis fit) after the compressed one
                assert got["compressed"][0] >= 1 and got["sample"][0] >= 4, f"{key}: {got}"
                assert got["compressed"][0] + got["sample"][0] == STEPS - GQ_WARMUP, f"{key}: {got}"
            elif not key.startswith("dense/"):
                assert got["compressed"][0] == OTHER_STEPS - 1, f"{key}: {got['compressed']}"
                assert got["worker_only"], f"{key}: exchanges did not run on the worker thread"
                assert got["inline_only"], f"{key}: synchronous engine ran exchanges off the hook thread"


def _mismatch(rank: int, ws: int, how: str) -> str:
    model = _model()
    ddp = DDP(model, bucket_cap_mb=0.002)
    engine = GCEngine(build_compressor("topk", ratio=0.1),
                      EngineConfig(plan="layer", min_compress_numel=0, warmup_steps=1, check_every=1),
                      list(model.named_parameters()))
    ddp.register_comm_hook(engine, gc_comm_hook)
    try:
        for step in range(4):
            if step == 2 and rank == 1:
                if how == "ratio":  # behind the engine's back: bypasses set_ratio's agreement
                    engine.compressor.config = dataclasses.replace(engine.compressor.config, ratio=0.3)
                else:  # a rank that believes it is at another step (dense warm-up vs compressed)
                    engine.step = 0
            x, y = _batch(rank, step)
            ddp.zero_grad()
            torch.nn.functional.mse_loss(ddp(x), y).backward()
        return "no error"
    except RuntimeError as e:
        return str(e)
    finally:
        engine.close()


@pytest.mark.parametrize("how", ["ratio", "step"])
def test_different_exchange_sequences_fail_fast_on_every_rank(how):
    results = run_distributed(_mismatch, 2, how, timeout=300)
    for msg in results:
        assert "about to issue different exchanges" in msg, msg
        assert "[[0], [1]]" in msg, msg


def _set_ratio(rank: int, ws: int, same: bool) -> dict:
    model = _model()
    ddp = DDP(model)
    engine = GCEngine(build_compressor("topk", ratio=0.1),
                      EngineConfig(plan="model", min_compress_numel=0, warmup_steps=0), list(model.named_parameters()))
    ddp.register_comm_hook(engine, gc_comm_hook)
    payload = []
    error = None
    for step in range(3):
        if step == 1:
            try:
                engine.set_ratio(0.5 if same else 0.5 + 0.1 * rank)
            except RuntimeError as e:
                error = str(e)
                break
        x, y = _batch(rank, step)
        ddp.zero_grad()
        torch.nn.functional.mse_loss(ddp(x), y).backward()
        engine.before_optimizer_step()
        payload.append(engine.last_step.bytes_payload)
    engine.close()
    return {"payload": payload, "error": error, "numel": sum(p.numel() for p in model.parameters())}


def test_set_ratio_agreed_changes_k_and_disagreement_is_refused():
    for res in run_distributed(_set_ratio, 2, True):
        n = res["numel"]
        k = [-(-n // 10), -(-n // 2)]  # ceil(0.1 n), ceil(0.5 n)
        # payload = k fp32 values + k int32 indices (allgather format, 8-byte aligned parts)
        assert res["payload"] == [8 * k[0], 8 * k[1], 8 * k[1]], res
        assert res["error"] is None
    for res in run_distributed(_set_ratio, 2, False):
        assert res["error"] is not None and "different ratios" in res["error"], res
    with pytest.raises(ValueError, match="must lie in"):
        build_compressor("topk", ratio=0.1).set_ratio(1.5)


def _rank_dependent_ratio(rank: int, ws: int) -> str:
    model = _model()
    try:
        GCEngine(build_compressor("topk", ratio=0.01 * (1 + rank)), EngineConfig(), list(model.named_parameters()))
    except RuntimeError as e:
        return str(e)
    return "no error"


def test_rank_dependent_compressor_option_detected_at_setup():
    for msg in run_distributed(_rank_dependent_ratio, 2):
        assert "ranks built different communication setups" in msg and "[[0], [1]]" in msg, msg
        assert "ratio=0.01" in msg and "ratio=0.02" in msg, msg


def _nonfinite_dense(rank: int, ws: int, overlap: bool) -> dict:
    model = _model()
    ddp = DDP(model, bucket_cap_mb=0.002)
    engine = GCEngine(build_compressor("topk", ratio=0.1),
                      EngineConfig(warmup_steps=3, min_compress_numel=0, overlap=overlap), list(model.named_parameters()))
    ddp.register_comm_hook(engine, gc_comm_hook)
    flags = []
    for step in range(5):  # steps 0-2 dense (warm-up), 3-4 compressed; NaN at 1 (dense) and 4 (compressed)
        x, y = _batch(rank, step)
        if step in (1, 4) and rank == 1:
            x[0, 0] = float("nan")
        ddp.zero_grad()
        torch.nn.functional.mse_loss(ddp(x), y).backward()
        flags.append((engine.before_optimizer_step(), engine.last_step.dense, engine.last_step.nonfinite))
    totals = engine.totals()
    engine.close()
    return {"flags": flags, "nonfinite_steps": totals["nonfinite_steps"], "steps": totals["steps"]}


@pytest.mark.parametrize("overlap", [True, False])
def test_nonfinite_counted_on_dense_and_compressed_steps(overlap):
    for res in run_distributed(_nonfinite_dense, 2, overlap, timeout=300):
        assert [f[0] for f in res["flags"]] == [False, True, False, False, True], res
        assert [f[1] for f in res["flags"]] == [True, True, True, False, False], res
        assert [f[2] for f in res["flags"]] == [f[0] for f in res["flags"]], res
        assert res["nonfinite_steps"] == 2 and res["steps"] == 5, res
