"""``lightning-gc advise --ranks-per-node``: each candidate flat and by nodes (bench/advise_nodes.py,
comm/cost_model.py's topology functions). Pure: no process group.

Oracles: byte counts and times written here from the byte model of docs/topology.md (reduce-scatter
and allgather inside a node of k ranks, the shard's exchange between nodes with the k ranks of a
node sharing its card), never by calling the functions under test; orderings where the answer
follows from the model without computing it; the command's text and JSON for 8 nodes x 8 GPUs.
"""

from __future__ import annotations

import json

import pytest

from lightning_gc.auto.model import MethodCost, Workload
from lightning_gc.bench import advise as adv
from lightning_gc.bench import advise_nodes as an
from lightning_gc.comm import cost_model as cm
from lightning_gc.comm.cost_model import NetworkModel

M = 4_000_000.0  # a group of 1M fp32 elements


# ---------------------------------------------------------------- 1. bytes, by hand
@pytest.mark.parametrize("nodes,k,intra,inter,card,flat_card", [
    # 2 x 2: (k-1)/k * (M + M) inside; 2(nodes-1)/nodes * M/k between; the card k times that;
    # flat ring 2(N-1)/N * M: by nodes 2/3 of the flat ring's bytes on the card (docs/topology.md)
    (2, 2, 0.5 * 2 * M, 2 * 1 / 2 * M / 2, 2 * (2 * 1 / 2 * M / 2), 2 * 3 / 4 * M),
    # 8 x 8: 7/8 * 2M inside; 2 * 7/8 * M/8 between; x 8 on the card; flat 2 * 63/64 * M
    (8, 8, 7 / 8 * 2 * M, 2 * 7 / 8 * M / 8, 8 * (2 * 7 / 8 * M / 8), 2 * 63 / 64 * M),
])
def test_dense_allreduce_bytes(nodes, k, intra, inter, card, flat_card):
    got = cm.nodes_exchange_bytes(M, nodes, k)
    assert got.intra == pytest.approx(intra) and got.inter == pytest.approx(inter) and got.card == pytest.approx(card)
    assert cm.flat_card_bytes("allreduce", M, nodes * k, k) == pytest.approx(flat_card)


def test_allgather_codec_bytes():
    P = 34_736.0  # a flat payload (Top-k 1 % of 434,176 elements: k values + k int32 indices)
    Ps = P / 2  # the shard's payload at k = 2
    # 2 x 2, direct exchange both ways: flat, each of a host's 2 ranks sends its payload to the 2 ranks of
    # the other host (2*2*P); by nodes each of the 2 ranks sends its shard payload to 1 other node (2*1*Ps)
    assert cm.flat_card_bytes("allgather", P, 4, 2, direct=True) == pytest.approx(4 * P)
    got = cm.nodes_exchange_bytes(4 * 434_176, 2, 2, "allgather", Ps, direct=True)
    assert got.inter == pytest.approx(Ps) and got.card == pytest.approx(2 * Ps)
    assert got.intra == pytest.approx(0.5 * 2 * 4 * 434_176)
    assert (4 * P) / got.card == pytest.approx(4.0)  # k^2 fewer bytes on the card
    # 8 x 8: flat ring allgather crosses each card once: (N-1) payloads; by nodes each of 8 ranks sends
    # (nodes-1) shard payloads of P/8
    assert cm.flat_card_bytes("allgather", P, 64, 8) == pytest.approx(63 * P)
    got = cm.nodes_exchange_bytes(M, 8, 8, "allgather", P / 8, direct=True)
    assert got.inter == pytest.approx(7 * P / 8) and got.card == pytest.approx(7 * P)
    # flat direct on 8 ranks as 2 hosts x 4: each of 4 ranks to the 4 of the other host
    assert cm.flat_card_bytes("allgather", P, 8, 4, direct=True) == pytest.approx(16 * P)


# ---------------------------------------------------------------- 2. times, by hand
AI, BI = 1e-5, 8 / 400e9  # inside a node: 10 us, 400 Gbit/s
AE, BE = 1e-4, 8 / 10e9  # a node's card: 0.1 ms, 10 Gbit/s


def test_dense_allreduce_time_2x2():
    # reduce-scatter (1 step of M/2 at BI), ring allreduce of the M/2 shard on 2 nodes at the card's rate
    # shared by 2 ranks (2 steps of M/4 at 2*BE), allgather (1 step of M/2 at BI)
    want = (AI + M / 2 * BI) + (2 * AE + 2 * (M / 4) * (2 * BE)) + (AI + M / 2 * BI)
    assert cm.nodes_exchange_cost(AI, BI, AE, BE, M, 2, 2) == pytest.approx(want, rel=1e-12)


def test_dense_allreduce_time_8x8():
    shard = M / 8
    want = (7 * AI + 7 / 8 * M * BI) + (14 * AE + 2 * 7 / 8 * shard * 8 * BE) + (7 * AI + 7 / 8 * M * BI)
    assert cm.nodes_exchange_cost(AI, BI, AE, BE, M, 8, 8) == pytest.approx(want, rel=1e-12)


def test_allgather_codec_time_2x2_and_8x8():
    P = 50_000.0
    # 2 x 2, direct between the 2 nodes: one latency, 1 shard payload at 2 * BE
    want = 2 * (AI + M / 2 * BI) + (AE + 1 * (P / 2) * 2 * BE)
    assert cm.nodes_exchange_cost(AI, BI, AE, BE, M, 2, 2, "allgather", P / 2, direct=True) == pytest.approx(want)
    # 8 x 8, ring allgather between nodes: ceil(log2 8) = 3 latencies, 7 shard payloads at 8 * BE
    want = 2 * (7 * AI + 7 / 8 * M * BI) + (3 * AE + 7 * (P / 8) * 8 * BE)
    assert cm.nodes_exchange_cost(AI, BI, AE, BE, M, 8, 8, "allgather", P / 8) == pytest.approx(want)
    # flat direct on 4 ranks, 2 per host: one latency, the card's 2 * 2 payloads
    assert cm.flat_direct_card_cost(AE, BE, P, 4, 2) == pytest.approx(AE + 4 * P * BE)


# ---------------------------------------------------------------- 3. flat vs nodes, where the answer is obvious
def _workload(numel: int = 1_000_000) -> Workload:
    return Workload(0.01, (0.02,), (numel,), 0.0, 0.0)


def _cluster(inter_bps: float, intra_bps: float, n: int = 64, k: int = 8, latency: float = 1e-4) -> an.Cluster:
    return an.Cluster(n, k, NetworkModel.from_bandwidth(inter_bps, latency),
                      NetworkModel.from_bandwidth(intra_bps, latency / 10))


def test_allgather_codec_on_a_slow_card_is_faster_by_nodes():
    """Top-k 1 % at 8 x 8, 1 Gbit/s cards, 10 Tbit/s inside: flat sends 63 payloads over the card,
    by nodes 7 payloads of 1/8 of it; the dense intra stages are nearly free."""
    numel = 1_000_000
    P = 8 * 0.01 * numel
    flat = MethodCost("topk", "allgather", 0.0, P, 0.1, True)
    shard = MethodCost("topk", "allgather", 0.0, P / 8, 0.1, True)
    c = _cluster(1e9, 1e13)
    f, nd = an.predict_flat(flat, _workload(numel), c, 0.0), an.predict_nodes(shard, _workload(numel), c, 0.0)
    assert nd.step_s < f.step_s
    row = an.compare(_workload(numel), [flat], {"topk": shard}, {}, c, 0.0).rows[0]
    assert row.faster == "nodes" and row.nodes_card_bytes < row.flat_card_bytes / 8


def test_dense_on_a_uniform_network_is_faster_flat():
    """DDP's allreduce when the link inside a node is no faster than the card and latency is nil: by
    nodes a rank sends 7/8 of the gradient twice inside, and the card 2 * 7/8 of it between nodes, one
    after the other (3.5 x the gradient's time); the flat ring 2 * 63/64 of it."""
    ddp = MethodCost("ddp", "bucket", 0.0)
    c = _cluster(10e9, 10e9, latency=0.0)
    row = an.compare(_workload(), [ddp], {"ddp": ddp}, {}, c, 0.0).rows[0]
    assert row.faster == "flat" and row.nodes.comm_s > row.flat.comm_s


# ---------------------------------------------------------------- 4. the command, 8 nodes x 8 GPUs
ARGS = ["--ranks", "64", "--ranks-per-node", "8", "--intra-bandwidth", "400gbit", "--compute-ms", "120",
        "--model-params", "200k", "--candidates", "ddp,topk,lowrank_bf16", "--repeats", "1"]


@pytest.fixture(scope="module")
def doc_10gbit():
    import contextlib
    import io

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        rc = adv.main([*ARGS, "--bandwidth", "10gbit", "--json"])
    assert rc == 0
    return json.loads(out.getvalue())


def test_cli_json_8x8_bytes_and_refusal(doc_10gbit):
    topo = doc_10gbit["topology"]
    assert topo["nodes"] == 8 and topo["ranks_per_node"] == 8
    assert topo["inter"]["bandwidth_bits_per_s"] == pytest.approx(10e9)
    assert topo["intra"]["bandwidth_bits_per_s"] == pytest.approx(400e9)
    rows = {r["name"]: r for r in topo["rows"]}
    g = 4 * 200_000  # the whole gradient in fp32
    # ddp: flat ring 2 * 63/64 * g on the card; by nodes 8 ranks x 2 * 7/8 * g/8
    assert rows["ddp"]["flat_card_bytes"] == pytest.approx(2 * 63 / 64 * g)
    assert rows["ddp"]["nodes_card_bytes"] == pytest.approx(8 * 2 * 7 / 8 * g / 8)
    # topk: flat (N-1) payloads; by nodes 8 x 7 shard payloads (Top-k 1 %: ceil(0.01 n) values + int32 indices)
    flat_payload = 8 * 2000
    shard_payload = 8 * 250  # ceil(0.01 * 25,000)
    assert rows["topk"]["flat_card_bytes"] == pytest.approx(63 * flat_payload)
    assert rows["topk"]["nodes_card_bytes"] == pytest.approx(8 * 7 * shard_payload)
    assert rows["lowrank_bf16"]["nodes"] is None and "lowrank" in rows["lowrank_bf16"]["refused"]
    assert rows["topk"]["faster"] == "nodes"
    best = topo["best"]
    assert best["topology"] in ("flat", "nodes") and best["candidate"] in rows


def test_cli_text_8x8_side_by_side(capsys):
    for bw in ("10gbit", "25gbit", "100gbit"):
        assert adv.main([*ARGS, "--bandwidth", bw]) == 0
        out = capsys.readouterr().out
        assert f"topology: 8 nodes x 8 ranks; between nodes {bw}" in out and "inside a node 400gbit" in out
        lines = {ln.split()[0]: ln for ln in out.splitlines() if ln.split() and "|" in ln}
        assert set(lines) >= {"candidate", "ddp", "topk", "lowrank_bf16"}
        assert "refused under nodes" in lines["lowrank_bf16"]
        assert lines["topk"].rstrip().split("|")[-1].split()[0] in ("flat", "nodes")
        assert "refused under nodes: lowrank_bf16: topology='nodes' with collective='lowrank'" in out
        assert "best of both:" in out


# ---------------------------------------------------------------- 5. refusals: value, reason, fix
@pytest.mark.parametrize("extra,needle", [
    (["--ranks-per-node", "3"], r"--ranks-per-node 3 does not divide --ranks 64.*Give a divisor of 64"),
    (["--ranks-per-node", "0"], r"--ranks-per-node 0 is not a number of ranks per node.*integer >= 1.*e\.g\."),
    (["--ranks-per-node", "-2"], r"--ranks-per-node -2 is not a number of ranks per node"),
    (["--ranks-per-node", "64"], r"--ranks-per-node 64 with --ranks 64 is one node.*Give fewer ranks per node"),
    (["--intra-bandwidth", "400gbit"], r"--intra-bandwidth '400gbit' with --ranks-per-node 1.*give --ranks-per-node"),
    (["--ranks-per-node", "8", "--intra-bandwidth", "fast"], r"--intra-bandwidth 'fast'"),
    (["--ranks-per-node", "8", "--intra-latency", "3 parsecs"], r"--intra-latency"),
])
def test_bad_topology_options_are_refused(capsys, extra, needle):
    import re

    rc = adv.main(["--ranks", "64", "--bandwidth", "10gbit", "--model-params", "1M", "--compute-ms", "100", *extra])
    err = capsys.readouterr().err
    assert rc == 2 and re.search(needle, err), err


@pytest.mark.parametrize("argv,needle", [
    (["--model-params", "1M"], "needs --compute-ms"),
    (["--compute-ms", "100"], "give the workload once"),
    (["--model-params", "1M", "--compute-ms", "100", "--preset", "mlp"], "give the workload once"),
    (["--model-params", "lots", "--compute-ms", "100"], "--model-params 'lots' is not a number of parameters"),
    (["--model-params", "1M", "--compute-ms", "-5"], "--compute-ms -5.0 must be a finite number >= 0"),
])
def test_bad_workload_options_are_refused(capsys, argv, needle):
    assert adv.main(["--ranks", "64", "--bandwidth", "10gbit", *argv]) == 2
    assert needle in capsys.readouterr().err


def test_compute_ms_with_its_parts_is_refused_and_scales_a_measured_profile():
    w = Workload(0.01, (0.02, 0.01), (10, 20), 0.01, 0.0)  # 50 ms of compute
    with pytest.raises(adv.AdviseError, match="--compute-ms 100.*either as a total"):
        adv.override_workload(w, forward_ms=3.0, compute_ms=100.0)
    out = adv.override_workload(w, compute_ms=100.0)  # x 2, the shares kept
    assert out.forward_s == pytest.approx(0.02) and out.backward_s == pytest.approx((0.04, 0.02))
    assert out.optimizer_s == pytest.approx(0.02)


def test_parse_count():
    assert adv.parse_count("350M") == 350_000_000 and adv.parse_count("1.3B") == 1_300_000_000
    assert adv.parse_count("200k") == 200_000 and adv.parse_count("12") == 12
    with pytest.raises(adv.AdviseError, match="e.g. --model-params 350M"):
        adv.parse_count("0")


# ---------------------------------------------------------------- 6. against the wire (docs/measurements/topology.md)
#: gpt, 2 hosts x 2 ranks at 20 Mbit/s: each host's transmit counter per step (headers included)
MEASURED_CARD = {"ddp": (2.64e6, None), "fp16": (1.32e6, None), "topk": (171.3e3, 55.1e3), "qsgd": (916.3e3, 241.1e3)}


def test_card_bytes_within_12_percent_of_the_measured_wire_at_2x2():
    """The model's bytes on a host's card (payloads as advise measures them on gpt: Top-k 34,736 B,
    QSGD 220,480 B flat, half of each per shard; 3,584 elements sent exactly) against the run's wire
    counters. The wire is above the model by the headers and the engine's small messages, most for
    Top-k by nodes, whose payload is the smallest."""
    numel, exact = 437_760, 4 * 3_584
    w = Workload(0.1, (0.1,), (numel,), 0.0, 0.0)
    c = _cluster(20e6, 10e9, n=4, k=2)
    flat = {"ddp": MethodCost("ddp", "bucket", 0.0), "fp16": MethodCost("fp16", "bucket", 0.0),
            "topk": MethodCost("topk", "allgather", 0.0, 34_736.0, exact_bytes=exact),
            "qsgd": MethodCost("qsgd", "allgather", 0.0, 220_480.0, exact_bytes=exact)}
    shard = {"topk": MethodCost("topk", "allgather", 0.0, 17_368.0, exact_bytes=exact),
             "qsgd": MethodCost("qsgd", "allgather", 0.0, 110_240.0, exact_bytes=exact)}
    errors = []
    for name, (wire_flat, wire_nodes) in MEASURED_CARD.items():
        errors.append(an.card_bytes_flat(flat[name], w, c) / wire_flat - 1)
        if wire_nodes is not None:
            errors.append(an.card_bytes_nodes(shard[name], w, c) / wire_nodes - 1)
    assert all(-0.12 < e <= 0.0 for e in errors), errors
