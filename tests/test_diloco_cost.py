"""DiLoCo's predicted step (lightning_gc/auto/diloco_cost.py) against the α-β arithmetic written out by hand.

The oracle is the schedule itself: a ring allreduce of M bytes on N ranks takes 2(N−1)·α + 2(N−1)/N·M·β and
sends 2(N−1)/N·M bytes per rank; F fragments of M/F each go once per H steps; with τ > 0 the exchange hides
behind τ steps of compute. No function of the library computes the expected numbers.
"""

from __future__ import annotations

import pytest

from lightning_gc.auto.diloco_cost import DiLoCoCandidate, predict_diloco
from lightning_gc.auto.model import Workload
from lightning_gc.comm.cost_model import NetworkModel

N = 4
NUMEL = 1_000_000
WORK = Workload(forward_s=0.02, backward_s=(0.03, 0.01), numels=(600_000, 400_000), optimizer_s=0.005, other_s=0.005)
COMPUTE = 0.07
ALPHA, BETA = 1e-3, 8 / 20e6  # 1 ms a message, 20 Mbit/s


def _ring(m: float, beta: float = BETA) -> float:
    return 2 * (N - 1) * ALPHA + 2 * (N - 1) / N * m * beta


NET = NetworkModel(alpha_s=ALPHA, beta_s_per_byte=BETA)


def test_plain_diloco_amortises_one_dense_exchange_and_its_flag_over_h():
    p = predict_diloco(DiLoCoCandidate(inner_steps=10), WORK, NET, N)
    m = 4 * NUMEL
    assert p.compute_s == pytest.approx(COMPUTE)
    assert p.exchange_s == pytest.approx(_ring(m))
    assert p.step_s == pytest.approx(COMPUTE + (_ring(m) + _ring(4)) / 10)
    assert p.bytes_per_step == pytest.approx(2 * (N - 1) / N * m / 10)


def test_h_one_dense_costs_a_whole_unoverlapped_allreduce_every_step():
    p = predict_diloco(DiLoCoCandidate(inner_steps=1), WORK, NET, N)
    assert p.step_s == pytest.approx(COMPUTE + _ring(4 * NUMEL) + _ring(4))


def test_fragments_send_the_same_bytes_in_f_exchanges_of_a_fth():
    one = predict_diloco(DiLoCoCandidate(inner_steps=12), WORK, NET, N)
    four = predict_diloco(DiLoCoCandidate(inner_steps=12, fragments=4), WORK, NET, N)
    assert four.bytes_per_step == pytest.approx(one.bytes_per_step)
    assert four.exchange_s == pytest.approx(_ring(NUMEL))  # 4 bytes x NUMEL / 4
    assert four.step_s == pytest.approx(COMPUTE + 4 * (_ring(NUMEL) + _ring(4)) / 12)
    assert four.step_s > one.step_s  # the same bytes, three more rounds of latency


def test_overlap_hides_the_exchange_behind_tau_steps_of_compute():
    x = _ring(NUMEL)  # a quarter of the model per fragment
    for tau in (1, 2):
        p = predict_diloco(DiLoCoCandidate(inner_steps=12, fragments=4, overlap_steps=tau), WORK, NET, N)
        assert p.exposed_s == pytest.approx(max(0.0, x - tau * COMPUTE))
        assert p.step_s == pytest.approx(COMPUTE + 4 * (_ring(4) + max(0.0, x - tau * COMPUTE)) / 12)
    fast = NetworkModel(alpha_s=ALPHA, beta_s_per_byte=8 / 10e9)  # 10 Gbit/s: all of it hidden
    p = predict_diloco(DiLoCoCandidate(inner_steps=12, fragments=4, overlap_steps=2), WORK, fast, N)
    assert p.exposed_s == 0.0 and p.step_s == pytest.approx(COMPUTE + 4 * 2 * (N - 1) * ALPHA / 12, rel=1e-3)


def test_unequal_fragments_expose_what_each_share_does_not_hide():
    # 400 Mbit/s, shares 0.7 / 0.3: τ = 1 step of compute hides the small fragment's exchange and part of
    # the large one's
    beta = 8 / 400e6
    net = NetworkModel(alpha_s=ALPHA, beta_s_per_byte=beta)
    cand = DiLoCoCandidate(inner_steps=12, fragments=2, overlap_steps=1, shares=(0.7, 0.3))
    p = predict_diloco(cand, WORK, net, N)
    x_big, x_small = _ring(4 * NUMEL * 0.7, beta), _ring(4 * NUMEL * 0.3, beta)
    assert x_small < COMPUTE < x_big
    assert p.exchange_s == pytest.approx(x_big)
    assert p.step_s == pytest.approx(COMPUTE + (2 * _ring(4, beta) + (x_big - COMPUTE)) / 12)
    equal = predict_diloco(DiLoCoCandidate(inner_steps=12, fragments=2, overlap_steps=1), WORK, net, N)
    assert equal.step_s < p.step_s  # two halves would hide more
    assert p.bytes_per_step == pytest.approx(equal.bytes_per_step)


def test_a_gathered_sparse_delta_sends_every_peer_its_payload():
    # 1/64 of the elements at ~2 bytes each; on 4 ranks the engine's direct exchange: α + (N−1)·payload·β
    cand = DiLoCoCandidate(inner_steps=10, delta_bytes_per_element=2 / 64, wire="allgather")
    p = predict_diloco(cand, WORK, NET, N)
    payload = NUMEL * 2 / 64
    assert p.exchange_s == pytest.approx(ALPHA + (N - 1) * payload * BETA)
    assert p.bytes_per_step == pytest.approx((N - 1) * payload / 10)


def test_one_rank_is_its_compute():
    p = predict_diloco(DiLoCoCandidate(inner_steps=5), WORK, NET, 1)
    assert (p.step_s, p.bytes_per_step) == (pytest.approx(COMPUTE), 0.0)


@pytest.mark.parametrize("kw, match", [
    (dict(inner_steps=0), "inner_steps=0"),
    (dict(inner_steps=4, fragments=5), "fragments=5"),
    (dict(inner_steps=8, fragments=2, overlap_steps=4), r"\[0, 4\)"),
    (dict(inner_steps=8, delta_bytes_per_element=0.0), "delta_bytes_per_element=0.0"),
    (dict(inner_steps=8, wire="ring"), "wire='ring'"),
    (dict(inner_steps=8, fragments=2, shares=(0.5,)), "shares"),
    (dict(inner_steps=8, fragments=2, shares=(0.6, 0.6)), "summing to 1"),
    (dict(inner_steps=8, fragments=2, shares=(1.0, 0.0)), "positive"),
])
def test_refuses_a_configuration_diloco_would_refuse(kw, match):
    with pytest.raises(ValueError, match=match):
        DiLoCoCandidate(**kw)
