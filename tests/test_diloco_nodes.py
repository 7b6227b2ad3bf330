"""DiLoCo with nodes as its workers (``sync="diloco", topology="nodes"``; lightning_gc/sync/diloco_nodes.py).

Four gloo processes play two "nodes" of two ranks (``topology_ranks_per_node=2``), each rank on
rank-dependent data, driven through the real assembly (:func:`lightning_gc.assembly.build_session`)
and the step session. The oracles do not reuse lightning_gc's code:

* a reference built in the test from all four ranks' batches: per node one replica, driven by the
  mean of its two ranks' gradients through ``torch.optim.AdamW`` for H steps from the shared start;
  Δ per node; the mean over the nodes; the outer Nesterov SGD replayed by hand;
* ranks bit-identical inside a node after every inner step (and the nodes apart), all four after
  every outer step;
* the inter-node bytes of an outer step against the byte model stated in the test;
* a run checkpointed mid-round and resumed continues bit for bit (per-shard error memory included).
"""

from __future__ import annotations

import io
import re
import warnings

import pytest
import torch
from dist_harness import gather_all, run_distributed
from torch.nn.parallel import DistributedDataParallel as DDP

from lightning_gc.assembly import build_session
from lightning_gc.callbacks.monitor import diloco_step_metrics
from lightning_gc.comm.hierarchy import refusal
from lightning_gc.config import GCConfig
from lightning_gc.summary import summarize

WS, K = 4, 2  # 2 nodes x 2 ranks
H = 3
INNER_LR, OUTER_LR, MOMENTUM = 0.02, 0.7, 0.9


def _model(bn: bool = False) -> torch.nn.Module:
    torch.manual_seed(0)
    norm = [torch.nn.BatchNorm1d(9)] if bn else []  # floating buffers: averaged at every outer step
    return torch.nn.Sequential(torch.nn.Linear(12, 9), *norm, torch.nn.Tanh(), torch.nn.Linear(9, 5))  # 167: odd


def _batch(rank: int, step: int):
    g = torch.Generator().manual_seed(1000 * rank + step)
    x = torch.randn(8, 12, generator=g) * (1.0, 2.5, 0.7, 1.6)[rank]
    return x, torch.randint(0, 5, (8,), generator=g)


def _loss(m, x, y):
    return torch.nn.functional.cross_entropy(m(x), y)


def _flat(model) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()]).clone()


def _build(h: int = H, pending: dict | None = None, weights: dict | None = None, compressor: str = "dense",
           bn: bool = False, **flat):
    model = _model(bn)
    if weights is not None:  # what Lightning restores before the strategy: the checkpoint's weights (θ_outer)
        model.load_state_dict(weights)
    ddp = DDP(model)
    cfg = GCConfig.from_flat(sync="diloco", topology="nodes", topology_ranks_per_node=K, diloco_inner_steps=h,
                             compressor=compressor, **flat)
    asm = build_session(cfg, ddp, pending_state=pending, announce=False)
    opt = torch.optim.AdamW(model.parameters(), lr=INNER_LR)
    return model, ddp, asm, opt


def _step(ddp, asm, opt, rank: int, step: int) -> None:
    x, y = _batch(rank, step)

    def closure():
        opt.zero_grad()
        loss = _loss(ddp, x, y)
        loss.backward()
        return loss

    asm.session.optimizer_step(opt, closure, lambda c: opt.step(c))


# ---------------------------------------------------------------------- the oracle (no lightning_gc code)
def _reference(steps: int) -> torch.Tensor:
    """θ after ``steps`` optimizer steps (a multiple of H), from all ranks' batches."""
    nodes = WS // K
    outer = [p.detach().clone() for p in _model().parameters()]
    replicas = [_model() for _ in range(nodes)]
    inner = [torch.optim.AdamW(r.parameters(), lr=INNER_LR) for r in replicas]
    buf = None
    for t in range(steps):
        for n, (rep, opt) in enumerate(zip(replicas, inner)):
            grads = []
            for rank in range(n * K, (n + 1) * K):
                rep.zero_grad()
                _loss(rep, *_batch(rank, t)).backward()
                grads.append([p.grad.clone() for p in rep.parameters()])
            for i, p in enumerate(rep.parameters()):
                p.grad = sum(g[i] for g in grads) / K
            opt.step()
        if (t + 1) % H == 0:
            deltas = [[o - p.detach() for o, p in zip(outer, rep.parameters())] for rep in replicas]
            mean = [sum(d[i] for d in deltas) / nodes for i in range(len(outer))]
            # outer SGD, momentum 0.9, Nesterov (torch.optim.SGD's rule: the buffer starts at the gradient)
            buf = [m.clone() for m in mean] if buf is None else [MOMENTUM * b + m for b, m in zip(buf, mean)]
            outer = [o - OUTER_LR * (m + MOMENTUM * b) for o, m, b in zip(outer, mean, buf)]
            for rep in replicas:
                with torch.no_grad():
                    for p, o in zip(rep.parameters(), outer):
                        p.copy_(o)
    return torch.cat([o.reshape(-1) for o in outer])


def _train(rank: int, ws: int) -> dict:
    model, ddp, asm, opt = _build()
    diloco = asm.diloco
    steps = 2 * H
    in_node, all_same, nodes_apart, inter, inner_bytes = True, True, True, [], []
    for t in range(steps):
        _step(ddp, asm, opt, rank, t)
        flat = _flat(model)
        others = gather_all(flat, ws)
        in_node = in_node and torch.equal(others[rank], others[rank ^ 1])  # the other rank of this node
        if (t + 1) % H == 0:
            all_same = all_same and all(torch.equal(flat, o) for o in others)
            inter.append(diloco.last_stats.bytes_inter_node)
        else:
            nodes_apart = nodes_apart and not torch.equal(others[0], others[2])
        inner_bytes.append(diloco.inner_bytes)
    totals = asm.engine.totals()
    summary = summarize(asm.engine, "dense", 0, diloco)
    metrics = diloco_step_metrics(diloco)
    out = {"params": _flat(model), "in_node": in_node, "all_same": all_same, "nodes_apart": nodes_apart,
           "inter": inter, "inner_bytes": inner_bytes, "total_inter": totals["bytes_inter_node"],
           "summary_inter": summary.bytes_inter_node, "summary_text": summary.format(),
           "metric_inter": metrics.get("gc/bytes_inter_node"), "header": asm.header,
           "numel": sum(p.numel() for p in model.parameters()), "tensors": len(list(model.parameters()))}
    asm.session.close()
    return out


@pytest.fixture(scope="module")
def trained():
    return run_distributed(_train, WS, timeout=150)


def test_two_outer_rounds_equal_the_node_workers_reference(trained):
    want = _reference(2 * H)
    for r in trained:
        err = float((r["params"] - want).abs().max() / want.abs().max())
        assert err <= 1e-6, err


def test_ranks_identical_inside_a_node_every_step_and_everywhere_after_an_outer_step(trained):
    for r in trained:
        assert r["in_node"] and r["all_same"]
        assert r["nodes_apart"]  # inner steps really are per node: the two nodes' replicas differ between rounds
        assert "workers=nodes(2x2)" in r["header"]


def test_inter_node_bytes_per_outer_step_follow_the_byte_model(trained):
    # Byte model, dense fp32 Δ of n elements, 2 nodes x k=2 ranks: each rank sends its shard of
    # s = ⌈n/k⌉ elements in a ring allreduce over the 2 nodes, 2(nodes−1)/nodes · 4s = 4s bytes;
    # a node's card carries k · 4s ≈ 4n bytes: the model once per node. Inner steps send nothing
    # between nodes; inside the node each sends 2(k−1)/k · 4(n + tensors) (gradients and presence flags).
    for r in trained:
        n, s = r["numel"], -(-r["numel"] // K)
        per_outer = 2 * (WS // K - 1) * 4 * s // (WS // K)
        assert r["inter"] == [per_outer, per_outer]
        assert K * per_outer == 4 * (n + 1)  # n = 167 is odd: the shards carry one padding element
        assert r["total_inter"] == r["summary_inter"] == 2 * per_outer  # nothing else crossed the nodes
        assert r["metric_inter"] == per_outer  # the last step was an outer step: gc/bytes_inter_node
        assert f"between nodes: {2 * per_outer} B" in r["summary_text"] and "nodes are the workers" in r["summary_text"]
        assert r["inner_bytes"] == [2 * (K - 1) * 4 * (n + r["tensors"]) // K] * (2 * H)


# ---------------------------------------------------------------------- resume, compressed Δ
def _resume(rank: int, ws: int) -> dict:
    steps, stop = 2 * H + 1, H + 1  # the checkpoint falls one inner step into the second round
    flat = dict(compressor="topk", ratio=0.1, error_feedback=True)
    model, ddp, asm, opt = _build(**flat)
    saved = None
    for t in range(steps):
        if t == stop:
            with asm.session.evaluation_view():
                weights = {k: v.clone() for k, v in model.state_dict().items()}
            buf = io.BytesIO()
            torch.save({"gc": asm.session.state_dict(), "opt": opt.state_dict(), "weights": weights}, buf)
            saved = buf.getvalue()
        _step(ddp, asm, opt, rank, t)
    straight = _flat(model)
    memory = asm.diloco.memory.clone()
    shard = -(-sum(p.numel() for p in model.parameters()) // K)
    asm.session.close()

    ckpt = torch.load(io.BytesIO(saved), weights_only=False)
    opt0 = gather_all_objects(ckpt["opt"], rank, ws)  # Lightning restores rank 0's optimizer state everywhere
    model2, ddp2, asm2, opt2 = _build(pending=ckpt["gc"], weights=ckpt["weights"], **flat)
    opt2.load_state_dict(opt0)
    asm2.session.on_optimizer_state_loaded([opt2])
    for t in range(stop, steps):
        _step(ddp2, asm2, opt2, rank, t)
    out = {"straight": straight, "resumed": _flat(model2), "memory": memory, "memory2": asm2.diloco.memory.clone(),
           "shard": shard}
    asm2.session.close()
    return out


def gather_all_objects(obj, rank: int, ws: int):
    """Rank 0's ``obj`` on every rank."""
    import torch.distributed as dist

    box = [obj if rank == 0 else None]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def test_a_run_checkpointed_mid_round_resumes_bit_for_bit_with_its_shard_memory():
    res = run_distributed(_resume, WS, timeout=150)
    for r in res:
        assert torch.equal(r["straight"], r["resumed"])
        assert r["memory"].numel() == r["shard"] and r["memory"].abs().sum() > 0  # per shard, and in use
        assert torch.equal(r["memory"], r["memory2"])
    assert not torch.equal(res[0]["memory"], res[1]["memory"])  # the node's two ranks keep different shards


# ---------------------------------------------------------------------- refusals
@pytest.mark.parametrize("flat,match", [
    (dict(compressor="lowrank"), "sync='diloco'.*collective='lowrank' is not supported"),
    (dict(compressor="marsit"), "sync='diloco'.*collective='marsit' is not supported"),
    (dict(compressor="star_topk"), "sync='diloco'.*collective='art_allreduce' is not supported"),
    (dict(topology_intra_dtype="bf16"), "sync='diloco' and topology_intra_dtype='bf16' is not supported"),
])
def test_refused_at_construction_with_reason_and_fix(flat, match):
    with pytest.raises(ValueError, match=match) as info:
        GCConfig.from_flat(sync="diloco", topology="nodes", **flat)
    assert re.search(r"\b(use|pass|set)\b", str(info.value).lower())


def test_what_runs_with_nodes_as_workers():
    for flat in (dict(), dict(compressor="fp16"), dict(compressor="topk"), dict(compressor="qsgd"),
                 dict(diloco_compressor="sparseloco"), dict(diloco_fragments=2, diloco_overlap_steps=1,
                                                            diloco_inner_steps=4)):
        assert GCConfig.from_flat(sync="diloco", topology="nodes", **flat).topology.kind == "nodes", flat
    # the pure list still refuses what DiLoCo does not change: AdaptiveRatio attaching to such a strategy
    assert "AdaptiveRatio" in refusal(collective="allreduce", sync="diloco", omgs=False, auto=False, adaptive=True)


# ---------------------------------------------------------------------- streaming, and a resume on another layout
def _streaming(rank: int, ws: int) -> dict:
    flat = dict(compressor="topk", ratio=0.2, error_feedback=True, diloco_fragments=2, diloco_overlap_steps=1)
    model, ddp, asm, opt = _build(h=4, bn=True, **flat)
    in_node = True
    for t in range(10):  # fragments sent at 2 and 4 (+4k), applied one step later; fragment 1 sent at 10 is in flight
        _step(ddp, asm, opt, rank, t)
        others = gather_all(_flat(model), ws)
        in_node = in_node and torch.equal(others[rank], others[rank ^ 1])
    open_round = asm.diloco.round_open
    state = asm.session.state_dict()  # mid-round: θ_local differs from θ_outer
    stats = torch.cat([model[1].running_mean, model[1].running_var])
    want = sum(gather_all(stats, ws)) / ws  # the buffers' mean over all ranks
    asm.session.finish()  # the closing round
    others = gather_all(_flat(model), ws)
    got = torch.cat([model[1].running_mean, model[1].running_var])
    out = {"in_node": in_node, "open": open_round, "all_same": all(torch.equal(others[0], o) for o in others),
           "inter": asm.engine.totals()["bytes_inter_node"], "buffers": float((got - want).abs().max()),
           "buffers_same": all(torch.equal(got, o) for o in gather_all(got, ws)),
           "buffers_differed": not torch.equal(stats, want)}
    asm.session.close()

    # the same checkpoint on a flat layout: each rank's θ_local belongs to the node layout and is not loaded
    model2 = _model(bn=True)
    ddp2 = DDP(model2)
    cfg = GCConfig.from_flat(sync="diloco", diloco_inner_steps=4, **flat)
    with warnings.catch_warnings(record=True) as caught:  # (rank_zero_warn: rank 0's is checked)
        warnings.simplefilter("always")
        asm2 = build_session(cfg, ddp2, pending_state=state, announce=False)
    out["warned"] = any(re.search(r"workers=nodes\(2x2\).*workers=ranks", str(w.message)) for w in caught)
    outer = torch.cat([o.reshape(-1) for o in asm2.diloco.theta_outer])
    out["flat_loads_outer"] = torch.equal(_flat(model2), outer) and not asm2.diloco.memories
    asm2.session.close()
    return out


def test_streaming_by_nodes_keeps_nodes_identical_and_a_flat_resume_restarts_the_round():
    res = run_distributed(_streaming, WS, timeout=150)
    for r in res:
        assert r["in_node"] and r["open"] and r["all_same"]
        assert r["inter"] > 0
        assert r["flat_loads_outer"]
        assert r["buffers_differed"] and r["buffers_same"] and r["buffers"] <= 1e-6
    assert res[0]["warned"]


def test_the_outer_shard_context_names_the_node_and_the_shard():
    """The Δ compressor by nodes sees rank = node, world = nodes and shard = local rank (its random
    streams then differ between the node's shards), and the shard's own segments."""
    from lightning_gc.compressors import GroupContext
    from lightning_gc.sync.diloco_nodes import NodeWorkers

    workers = NodeWorkers.__new__(NodeWorkers)  # the layout alone: no process groups needed here
    workers.k, workers.nodes, workers.node, workers.local = 2, 3, 2, 1
    ctx = GroupContext(step=4, rank=5, world_size=6, segments=(3, 4), group_id=7, seed=1, names=("a", "b"))
    got = workers.context(ctx, 7)
    assert (got.rank, got.world_size, got.shard, got.group_id, got.step) == (2, 3, 1, 7, 4)
    assert got.segments == (3, 1) and got.names == ()  # elements 4..7 of 7: b's last 3, then one of padding
