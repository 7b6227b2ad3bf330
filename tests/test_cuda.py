"""The CUDA path: the engine with CUDA tensors, its side stream and events, several ranks on one GPU.

Skipped where torch sees no CUDA device (the CI machine); run on a GPU with ``pytest -m cuda
tests/test_cuda.py`` (docs/gpu.md says what was run, where, and what it found).

Several ranks on **one** GPU: NCCL refuses two ranks of one communicator on the same device, so the
ranks here use **gloo with CUDA tensors**: the model, the DDP buckets, the engine's flat groups,
its compressors and its side stream are all on ``cuda:0``; gloo copies through host memory for its
collectives. What that exercises is the CUDA path of lightning_gc itself (the worker's side
stream, the events between the autograd stream and the worker, CUDA-aware futures, device
placement in every compressor), not NCCL's transport.

* Every compressor with a collective it can travel by (the pairs of the CPU stress test,
  tests/test_engine_overlap.py): two replicas per rank, ``overlap=True`` and ``overlap=False``, must
  produce bit-identical gradients at every step, and the parameters must be bit-identical across
  ranks. Point-to-point collectives (our rings and trees: Marsit's, GradiVeQ's, AR-Topk's ART-Ring
  and ART-Tree, the RandomK and 16-bit rings and trees) need ``isend``/``irecv`` of CUDA tensors,
  which gloo does not have (a probe checks that fact, so the day torch adds it this file says so).
  On gloo they stage every message through host memory (lightning_gc/comm/p2p.py): those pairs must
  pass the same checks and must have staged messages. Before the staging they were refused, and
  before the refusal a rank died at the first compressed step.
* The plain dense method equals DDP without a hook bit for bit, on CUDA.
* Stream and event correctness, checked rather than assumed: a delay is put on both sides of every
  hand-over. On the autograd stream, each bucket is zeroed, a ~20 ms GPU sleep queued, and the
  bucket restored before the hook sees it, so a worker that does not wait for the bucket's ready
  event reads zeros; on the side stream, a GPU sleep is queued after every exchange, and each bucket
  is zeroed, slept on and restored just before its Future is completed (after the step's last host
  synchronisation), so a Future that does not make DDP's stream wait for the worker's kernels hands
  DDP a zeroed bucket. The overlapped engine must still equal the synchronous one bit for bit.
  Removing the ``wait_event`` or the future's device list on purpose must make this test fail
  (``.ci/gpu``, docs/gpu.md).
"""

from __future__ import annotations

import threading

import pytest
import torch
import torch.distributed as dist
from dist_harness import run_distributed
from test_comm_p2p import _HAND_P2P
from test_engine_overlap import (
    GQ_WARMUP,
    OTHER_STEPS,
    PAIRS,
    STEPS,
    _batch,
    _engine,
    _model,
    train_replicas,
)
from torch.nn.parallel import DistributedDataParallel as DDP

from lightning_gc.compressors import build_compressor
from lightning_gc.engine import EngineConfig, GCEngine, gc_comm_hook

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

WORLD = 2
P2P_COLLECTIVES = _HAND_P2P  # the CPU staging test's hand-written list of point-to-point collectives
SLEEP_CYCLES = 40_000_000  # ~20 ms at ~2 GHz: far longer than any kernel of these tiny models


def _p2p_probe(rank: int, ws: int) -> str:
    torch.cuda.set_device(0)
    send = torch.full((4,), float(rank + 1), device="cuda")
    recv = torch.zeros(4, device="cuda")
    right, left = (rank + 1) % ws, (rank - 1) % ws
    ops = [dist.P2POp(dist.isend, send, right), dist.P2POp(dist.irecv, recv, left)]
    for w in dist.batch_isend_irecv(ops):
        w.wait()
    torch.cuda.synchronize()
    return "ok" if float(recv[0]) == float(left + 1) else f"received {recv.tolist()}, expected {left + 1}"


@pytest.mark.timeout(300)
def test_gloo_cannot_send_cuda_tensors_point_to_point():
    """Why the P2P collectives stage CUDA tensors through host memory on gloo. If this starts to
    pass, torch has gained the path: the staging can go (lightning_gc/comm/p2p.py, ``staged``)."""
    with pytest.raises(AssertionError, match="died without reporting|Connection closed|gloo"):
        run_distributed(_p2p_probe, WORLD, timeout=60)


def _delayed_hook(state: GCEngine, bucket: dist.GradBucket) -> torch.futures.Future:
    """The autograd stream's side of the hand-over made slow: the bucket is zero for ~20 ms of GPU
    time after the hook has been called, then restored; a worker that reads it without waiting for
    the bucket's ready event reads zeros."""
    buf = bucket.buffer()
    saved = buf.clone()
    buf.zero_()
    torch.cuda._sleep(SLEEP_CYCLES)
    buf.copy_(saved)
    return gc_comm_hook(state, bucket)


_delayed_hook.__annotations__ = dict(gc_comm_hook.__annotations__)  # DDP rejects postponed (string) annotations


def _delayed_finish(finish):
    """The hand-back made slow: just before a compressed step's bucket Futures are completed (on the
    worker's stream in the overlapped engine, after the step's last host synchronisation), each bucket
    is zeroed, ~20 ms of GPU sleep is queued and the bucket is restored. Only a CUDA-aware Future
    (``Future(devices=...)``, engine/readiness.py) makes DDP's stream wait for that work; a plain one
    lets DDP copy the bucket into ``.grad`` while it is still zero."""
    def slow(work):
        if not work.dense:
            for _fut, buffer in work.futures:
                saved = buffer.clone()
                buffer.zero_()
                torch.cuda._sleep(SLEEP_CYCLES)
                buffer.copy_(saved)
        return finish(work)
    return slow


def _cuda_pair(rank: int, ws: int, name: str, coll: str, delay: bool, min_numel: int = 0) -> dict:
    """``min_numel`` > 0 leaves the biases (16 elements) in the plan's exact group; under ``lowrank``
    that group rides in the last compressed group's first allreduce (``Exchange.run_with_exact``, or
    ``run_riding`` where that job also carries the step's closing report)."""
    torch.cuda.set_device(0)
    dev = torch.device("cuda", 0)
    models = [_model().to(dev), _model().to(dev)]
    ddps = [DDP(m, device_ids=[0], bucket_cap_mb=0.002) for m in models]
    network = (1e-6, 1e-6) if coll == "auto_sparse" else (1e-4, 8e-8)  # auto_sparse: ART-Ring, point to point
    engines = [_engine(m, name, coll, overlap, min_numel, network) for m, overlap in zip(models, (True, False))]
    from lightning_gc.comm import p2p

    staged = [0]
    host_send = p2p._host_send

    def counted(tensor, _real=host_send):
        staged[0] += 1
        return _real(tensor)

    p2p._host_send = counted  # this spawned rank's own module
    threads: list[set[int]] = [set(), set()]
    choices: set[str] = set()
    rode: list[int] = [0, 0]  # exchanges that carried the exact group
    for k, (eng, seen) in enumerate(zip(engines, threads)):
        run, run_exact = eng.exchange.run, eng.exchange.run_with_exact
        run_riding = eng.exchange.run_riding

        def traced(p, ctx, timer, _run=run, _seen=seen, _ex=eng.exchange):
            _seen.add(threading.get_ident())
            out = _run(p, ctx, timer)
            if getattr(_ex, "last_choice", None):  # auto_sparse: which collective the cost model picked
                choices.add(_ex.last_choice)
            if delay:  # the worker's side of the hand-over made slow (its own stream on the overlapped engine)
                torch.cuda._sleep(SLEEP_CYCLES)
            return out

        def traced_exact(p, ctx, timer, exact, _run=run_exact, _seen=seen, _k=k):
            _seen.add(threading.get_ident())
            rode[_k] += 1
            out = _run(p, ctx, timer, exact)
            if delay:
                torch.cuda._sleep(SLEEP_CYCLES)
            return out

        def traced_riding(p, ctx, timer, exact, report, _run=run_riding, _seen=seen, _k=k):
            # lowrank's step-closing job: the closing report rides in its Q message (report_rides)
            _seen.add(threading.get_ident())
            rode[_k] += exact is not None
            out = _run(p, ctx, timer, exact, report)
            if delay:
                torch.cuda._sleep(SLEEP_CYCLES)
            return out

        eng.exchange.run = traced
        eng.exchange.run_with_exact = traced_exact
        if type(eng.exchange).carries_report:
            eng.exchange.run_riding = traced_riding
        if delay:
            eng._finish = _delayed_finish(eng._finish)
    hook = _delayed_hook if delay else gc_comm_hook
    for d, e in zip(ddps, engines):
        d.register_comm_hook(e, hook)
    mismatch, diverged = train_replicas(rank, ws, name, models, ddps, engines, dev)
    totals = [e.totals() for e in engines]
    main = threading.get_ident()
    stream = engines[0]._runner._stream if hasattr(engines[0]._runner, "_stream") else None
    out = {
        "mismatch": mismatch[:3], "diverged": diverged[:3],
        "compressed": [t["compressed_steps"] for t in totals],
        "sample": [t["sample_steps"] for t in totals],
        "bytes": [t["bytes_sent"] for t in totals],
        "worker_only": bool(threads[0]) and main not in threads[0],
        "side_stream": stream is not None,
        "on_cuda": all(p.is_cuda for m in models for p in m.parameters()),
        "rode": rode,
        "staged": staged[0],
        "choices": sorted(choices),
    }
    for e in engines:
        e.close()
    return out


def _check(key: str, results: list[dict]) -> None:
    name, coll = key.split("/")
    for r, got in enumerate(results):
        # gloo cannot send CUDA tensors point to point: staged through host memory. auto_sparse stages
        # only where its cost model picked ART-Ring or ART-Tree (at 2 ranks it always picks allgather)
        p2p_used = bool({"art_ring", "art_tree"} & set(got["choices"])) if coll == "auto_sparse" else \
            coll in P2P_COLLECTIVES
        if p2p_used:
            assert got["staged"] > 0, f"{key} rank {r}: no message was staged: {got}"
        else:
            assert got["staged"] == 0, f"{key} rank {r}: a backend collective was staged: {got}"
        assert got["on_cuda"], f"{key} rank {r}: parameters left the GPU"
        assert not got["mismatch"], f"{key} rank {r}: overlapped != synchronous at {got['mismatch']}"
        assert not got["diverged"], f"{key} rank {r}: ranks diverged at steps {got['diverged']}"
        assert got["compressed"][0] == got["compressed"][1] and got["bytes"][0] == got["bytes"][1], f"{key}: {got}"
        if name == "gradiveq":
            assert got["compressed"][0] >= 1 and got["compressed"][0] + got["sample"][0] == STEPS - GQ_WARMUP, got
        elif name != "dense":
            assert got["compressed"][0] == OTHER_STEPS - 1, f"{key}: {got['compressed']}"
            assert got["worker_only"] and got["side_stream"], f"{key}: not run on the worker's CUDA stream: {got}"


@pytest.mark.timeout(900)
@pytest.mark.parametrize("name,coll", PAIRS, ids=[f"{n}-{c}" for n, c in PAIRS])
def test_cuda_overlapped_equals_synchronous_and_ranks_agree(name, coll):
    _check(f"{name}/{coll}", run_distributed(_cuda_pair, WORLD, name, coll, False, timeout=240))


@pytest.mark.timeout(900)
@pytest.mark.parametrize("name,coll", [("dense", "allreduce"), ("topk", "allgather"), ("qsgd", "allgather"),
                                       ("randomk", "allreduce"), ("lowrank", "lowrank"),
                                       ("star_topk", "art_allreduce"), ("marsit", "marsit")])
def test_cuda_stream_handover_survives_delays_on_both_sides(name, coll):
    _check(f"{name}/{coll}", run_distributed(_cuda_pair, WORLD, name, coll, True, timeout=240))


@pytest.mark.timeout(900)
def test_cuda_lowrank_carries_the_exact_group_through_delayed_handovers():
    """``lowrank`` with an exact group (the biases): the group rides in the P allreduce of the last
    compressed group, on the worker's stream; with delays on both sides of every hand-over the
    overlapped engine still equals the synchronous one bit for bit, on both ranks."""
    results = run_distributed(_cuda_pair, WORLD, "lowrank", "lowrank", True, 64, timeout=240)
    _check("lowrank/lowrank", results)
    for r, got in enumerate(results):  # every compressed step carried it, on both replicas
        assert got["rode"] == [OTHER_STEPS - 1] * 2, f"rank {r}: {got['rode']}"


def test_cuda_dense_step_carries_the_value_in_its_first_bucket():
    """GCEngine.enable_dense_carry on CUDA buckets: the oracle of the CPU test (gradients equal
    DDP's, every rank reads the mean of the carried values, one element more per step)."""
    from test_engine_distributed import _dense_carry, check_dense_carry

    check_dense_carry(run_distributed(_dense_carry, WORLD, "cuda", timeout=240), WORLD)


def _dense_vs_ddp(rank: int, ws: int) -> dict:
    torch.cuda.set_device(0)
    dev = torch.device("cuda", 0)
    models = [_model().to(dev), _model().to(dev)]
    ddps = [DDP(m, device_ids=[0], bucket_cap_mb=0.002) for m in models]
    engine = GCEngine(build_compressor("dense"), EngineConfig(plan="layer", min_compress_numel=0, warmup_steps=0),
                      list(models[0].named_parameters()))
    ddps[0].register_comm_hook(engine, gc_comm_hook)
    opts = [torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9) for m in models]
    worst = 0.0
    for step in range(5):
        x, y = (t.to(dev) for t in _batch(rank, step))
        for d, o in zip(ddps, opts):
            o.zero_grad()
            torch.nn.functional.mse_loss(d(x), y).backward()
        engine.before_optimizer_step()
        for a, b in zip(models[0].parameters(), models[1].parameters()):
            worst = max(worst, float((a.grad - b.grad).abs().max()))
        for o in opts:
            o.step()
    engine.close()
    return {"worst": worst, "equal": all(torch.equal(a, b) for a, b in zip(models[0].parameters(),
                                                                           models[1].parameters()))}


@pytest.mark.timeout(600)
def test_cuda_dense_equals_ddp_without_hook():
    for r, got in enumerate(run_distributed(_dense_vs_ddp, WORLD, timeout=240)):
        assert got["equal"] and got["worst"] == 0.0, f"rank {r}: {got}"


OSP_CASES = ["mixed_nesterov_wd", "no_buffer_yet_dampening_wd", "split_flips", "adamw_clip_norm",
             "adamw_no_state_yet_amsgrad"]


def _osp_cuda(rank: int, ws: int, delay: bool = False) -> dict:
    from test_osp import CASES, _run_osp

    torch.cuda.set_device(0)
    if delay:  # the default stream made slow just before OSP gathers the deferred layers' gradients
        from lightning_gc.sync.osp import OSPSync

        start = OSPSync.after_optimizer_step

        def slow(self):
            torch.cuda._sleep(SLEEP_CYCLES)
            return start(self)

        OSPSync.after_optimizer_step = slow  # this spawned rank's own copy of the class
    return {case: _run_osp(rank, ws, CASES[case]["hyper"], CASES[case]["fraction"], CASES[case]["max_fraction"],
                           "dense", 0.0001, CASES[case]["nan_at"], CASES[case]["scenario"], CASES[case]["opt"],
                           CASES[case]["clip"], device="cuda")
            for case in OSP_CASES}


@pytest.mark.timeout(600)
def test_cuda_osp_matches_the_delayed_correction_reference():
    """OSP on CUDA (its deferred exchange on its own worker stream, the events around it): the
    CPU suite's hand-written delayed-correction oracle (tests/test_osp.py), computed on the CPU from
    every rank's batches, for SGD with Nesterov and weight decay, a skipped first step (no momentum
    buffer yet), a split that flips, AdamW with norm clipping and AMSGrad from no state; ranks
    bit-identical after every correction."""
    from test_osp import _check_case

    runs = run_distributed(_osp_cuda, WORLD, timeout=300)
    for case in OSP_CASES:
        _check_case([r[case] for r in runs], case)


@pytest.mark.timeout(600)
def test_cuda_osp_handover_survives_a_slow_default_stream():
    """OSP's hand-over to its worker made slow: ~20 ms of GPU sleep is queued on the default stream
    just before ``after_optimizer_step`` concatenates the deferred layers' gradients, so a worker
    that starts the deferred allreduce without waiting for the recorded event reads the buffer
    before the concatenation has written it. The same oracle as above must still hold."""
    from test_osp import _check_case

    runs = run_distributed(_osp_cuda, WORLD, True, timeout=300)
    for case in OSP_CASES:
        _check_case([r[case] for r in runs], case)


def test_codec_bench_runs_every_compressor_on_cuda():
    from lightning_gc.bench.codec import CodecBenchConfig, failed_compressors, run_codec_bench

    doc = run_codec_bench(CodecBenchConfig(sizes=(100_000,), repeats=1, device="cuda"))
    assert doc["machine"]["device"].startswith("cuda")
    assert failed_compressors(doc) == []
