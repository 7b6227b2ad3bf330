"""``topology="auto"``: measure the link inside a node and the one between nodes, take ``nodes`` when
the one between is ``auto_ratio`` times slower per byte (lightning_gc/comm/hierarchy.py).

Oracles: the rule against hand-worked ratios; the agreed decision against the MAX of every rank's
own figures, computed in the test from all ranks' inputs (ranks see different links, so a rank that
decided alone would choose otherwise); the real probe on loopback with every rank making the same
choice and training bit-identical; the fallbacks without measuring.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from dist_harness import gather_all, run_distributed
from torch.nn.parallel import DistributedDataParallel as DDP

from lightning_gc.assembly import startup_header
from lightning_gc.comm.hierarchy import TopologyConfig, auto_fallback, build_topology, choose_kind
from lightning_gc.compressors import build_compressor
from lightning_gc.config import GCConfig
from lightning_gc.engine import EngineConfig, GCEngine, gc_comm_hook

WS, K = 4, 2
AUTO_2x2 = TopologyConfig(kind="auto", ranks_per_node=K)


# ---------------------------------------------------------------------- the rule, pure
def test_nodes_from_the_ratio_up_and_flat_below_it():
    assert choose_kind(1e-9, 4e-9, 4.0)[0] == "nodes"  # exactly the ratio
    assert choose_kind(1e-9, 3.99e-9, 4.0)[0] == "flat"
    assert choose_kind(2e-9, 5e-9, 2.0)[0] == "nodes"  # 2.5x against 2
    assert choose_kind(2e-9, 5e-9, 3.0)[0] == "flat"
    kind, why = choose_kind(1e-9, 8e-9, 4.0)
    assert kind == "nodes" and "8.0 times" in why and "topology_auto_ratio=4" in why


def test_a_link_too_fast_to_measure_inside_is_faster_than_any_measured_one_between():
    assert choose_kind(0.0, 1e-12, 4.0)[0] == "nodes"
    assert choose_kind(0.0, 0.0, 4.0)[0] == "flat"  # nothing seen on either: no reason to go by nodes


def test_flat_without_measuring_where_nodes_cannot_run_or_has_no_hop_to_spare():
    refused = GCConfig.from_flat(compressor="topk", sync="osp", topology="auto").topology_refusal()
    assert "OSP" in auto_fallback(4, 2, refused)
    assert auto_fallback(4, 4, None) == "one node"
    assert auto_fallback(4, 1, None) == "one rank per node"
    assert "pass topology_ranks_per_node" in auto_fallback(4, None, None)
    assert "not whole nodes" in auto_fallback(6, 4, None)
    assert auto_fallback(8, 4, None) is None


def test_auto_is_a_configuration_nodes_would_refuse_and_its_options_are_checked():
    cfg = GCConfig.from_flat(compressor="topk", sync="osp", topology="auto", topology_auto_ratio=3.0)
    assert cfg.topology.auto_ratio == 3.0 and cfg.to_flat()["topology_auto_ratio"] == 3.0
    with pytest.raises(ValueError, match="OSP"):
        GCConfig.from_flat(compressor="topk", sync="osp", topology="nodes")
    with pytest.raises(ValueError, match=r"topology_auto_ratio=1 must be a number > 1"):
        TopologyConfig(kind="auto", auto_ratio=1)
    with pytest.raises(ValueError, match="only applies with topology='auto'"):
        TopologyConfig(kind="nodes", auto_ratio=2.0)
    assert TopologyConfig(kind="auto", ranks_per_node=2, intra_dtype="bf16").intra_dtype == "bf16"


# ---------------------------------------------------------------------- agreed over the ranks
#: each rank's own (β inside, β between): rank 3 alone sees a slow link between nodes, rank 0 a
#: slower one inside; the agreed figures are the MAX of each column
VIEWS = {0: (2e-9, 3e-9), 1: (1e-9, 2e-9), 2: (1e-9, 1e-9), 3: (1.5e-9, 9e-9)}


def _agreed_choice(rank: int, ws: int, ratio: float) -> dict:
    seen: list = []

    def probe(group, device, model_bytes):  # this rank's view: the intra group first, then the inter one
        view = VIEWS[rank][len(seen)]
        seen.append(dist.get_process_group_ranks(group))
        return view

    cfg = TopologyConfig(kind="auto", ranks_per_node=K, auto_ratio=ratio)
    topo = build_topology(cfg, None, ws, rank, None, model_bytes=1 << 20, probe=probe)
    out = {"kind": topo.kind, "describe": topo.describe(), "chosen": topo.chosen, "groups": seen}
    topo.close()
    return out


@pytest.mark.parametrize("ratio", [4.0, 5.0])
def test_every_rank_takes_the_decision_of_the_agreed_figures(ratio):
    res = run_distributed(_agreed_choice, WS, ratio, timeout=120)
    intra = max(v[0] for v in VIEWS.values())
    inter = max(v[1] for v in VIEWS.values())
    want = "nodes" if inter / intra >= ratio else "flat"  # 9e-9 / 2e-9 = 4.5
    assert want == ("nodes" if ratio == 4.0 else "flat")
    for rank, r in enumerate(res):
        assert r["kind"] == want, (rank, r)
        assert r["describe"] == res[0]["describe"] and r["chosen"] == res[0]["chosen"]
        assert "4.5 times" in r["chosen"]
        node = rank // K
        assert r["groups"] == [[node * K, node * K + 1], [rank % K, rank % K + K]]  # inside, then between


# ---------------------------------------------------------------------- the real probe, end to end
def _train_auto(rank: int, ws: int) -> dict:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(24, 32), torch.nn.ReLU(), torch.nn.Linear(32, 7))
    ddp = DDP(model, bucket_cap_mb=0.002)
    comp = build_compressor("topk", ratio=0.25)
    engine = GCEngine(comp, EngineConfig(warmup_steps=1, min_compress_numel=0, seed=3), list(model.named_parameters()),
                      topology=AUTO_2x2)
    ddp.register_comm_hook(engine, gc_comm_hook)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    same = True
    for step in range(3):
        g = torch.Generator().manual_seed(100 * rank + step)
        x, y = torch.randn(16, 24, generator=g) * (1 + rank), torch.randint(0, 7, (16,), generator=g)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(ddp(x), y).backward()
        opt.step()
        flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
        same = same and all(torch.equal(flat, o) for o in gather_all(flat, ws))
    header = startup_header(GCConfig.from_flat(compressor="topk", ratio=0.25, topology="auto",
                                               topology_ranks_per_node=K), engine)
    out = {"describe": engine.topology.describe(), "chosen": engine.topology.chosen, "same": same, "header": header}
    engine.close()
    return out


def test_the_measured_choice_is_the_same_on_every_rank_and_trains_in_step():
    res = run_distributed(_train_auto, WS, timeout=150)
    for r in res:
        assert r["describe"] == res[0]["describe"] and r["chosen"] == res[0]["chosen"]
        assert r["describe"] in ("flat", "nodes(2x2,intra=fp32)")  # loopback both ways: either may win
        assert r["same"]
        assert f"topology=auto chose {r['describe']} (a byte took" in r["header"]
