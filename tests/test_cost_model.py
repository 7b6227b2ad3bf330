"""Alpha-beta cost model: hand-computed values, and rules 5a-5c against direct cost comparison."""

from __future__ import annotations

import itertools
import math

import pytest

from lightning_gc.comm import cost_model as cm
from lightning_gc.comm.cost_model import NetworkModel


# Independent re-statement of the paper's formulas (Table I, Sec. 3-D, Eq. 4a/4b) with
# L = ceil(log2 N), the rounds of the binomial trees that run (log2 N at powers of two).
def _L(N):
    return math.ceil(math.log2(N)) if N > 1 else 0


def _ag(a, b, M, N, c):
    return a * _L(N) + 2 * M * c * b * (N - 1)


def _ring(a, b, M, N, c):
    L = _L(N)
    return a * (2 * (N - 1) + L) + M * c * b * (2 * (N - 1) / N + L)


def _tree(a, b, M, N, c):
    L = _L(N)
    return 3 * a * L + 3 * M * c * b * L


def test_hand_computed_table_one() -> None:
    # alpha=1 s, beta=0.5 s/B, M=8 B, N=4 (log2 N = 2), all exact in binary floating point
    a, b, M, N = 1.0, 0.5, 8.0, 4
    assert cm.parameter_server_cost(a, b, M, N) == 2 + 2 * 3 * 8 * 0.5 == 26
    assert cm.ring_allreduce_cost(a, b, M, N) == 6 + 2 * 3 / 4 * 8 * 0.5 == 12
    assert cm.tree_allreduce_cost(a, b, M, N) == 2 * 2 + 2 * 2 * 8 * 0.5 == 20
    assert cm.broadcast_cost(a, b, M, N) == 2 + 2 * 8 * 0.5 == 10
    assert cm.allgather_cost(a, b, M, N) == 2 + 3 * 8 * 0.5 == 14


def test_hand_computed_sparse_costs_and_choice() -> None:
    # M*c = 2 bytes: AG = 2 + 2*2*0.5*3 = 8; ART-Ring = 1*(6+2) + 2*0.5*(1.5+2) = 11.5;
    # ART-Tree = 3*1*2 + 3*2*0.5*2 = 12  ->  allgather
    a, b, M, N, c = 1.0, 0.5, 8.0, 4, 0.25
    assert cm.sparse_collective_costs(a, b, M, N, c) == {"allgather": 8.0, "art_ring": 11.5, "art_tree": 12.0}
    assert cm.choose_sparse_collective(a, b, M, N, c) == "allgather"
    # 10 Gbit/s, 1 ms, 8 ranks, 100 MB dense, c = 0.1 (M*c = 1e7 B, beta = 8e-10 s/B):
    # AG = 3e-3 + 2*1e7*8e-10*7 = 0.115; Ring = 17e-3 + 1e7*8e-10*(1.75+3) = 0.055;
    # Tree = 9e-3 + 3*1e7*8e-10*3 = 0.081
    net = NetworkModel.from_bandwidth(10e9, 1e-3)
    assert net.beta_s_per_byte == pytest.approx(8e-10)
    costs = net.sparse_costs(1e8, 8, 0.1)
    assert costs["allgather"] == pytest.approx(0.115)
    assert costs["art_ring"] == pytest.approx(0.055)
    assert costs["art_tree"] == pytest.approx(0.081)
    assert net.choose_sparse_collective(1e8, 8, 0.1) == "art_ring"
    # same network, c = 0.001: AG = 3e-3 + 1.12e-3 wins over Ring = 17e-3 + ...
    assert net.choose_sparse_collective(1e8, 8, 0.001) == "allgather"


def test_eq4_is_broadcast_plus_allreduce() -> None:
    # Eq. 4a/4b = broadcast of M*c index bytes + ring/tree allreduce of M*c value bytes
    for a, b, M, N, c in [(1e-4, 8e-10, 4e7, 5, 0.01), (2e-3, 1e-9, 1e6, 16, 0.3)]:
        bc = cm.broadcast_cost(a, b, M * c, N)
        assert cm.art_ring_cost(a, b, M, N, c) == pytest.approx(bc + cm.ring_allreduce_cost(a, b, M * c, N))
        assert cm.art_tree_cost(a, b, M, N, c) == pytest.approx(bc + cm.tree_allreduce_cost(a, b, M * c, N))
        # int32 indices: sparse allgather = allgather of 2*M*c bytes per rank
        assert cm.sparse_allgather_cost(a, b, M, N, c) == pytest.approx(cm.allgather_cost(a, b, 2 * M * c, N))


ALPHAS = [0.0, 1e-6, 1e-5, 1e-4, 1e-3, 5e-3]
BETAS = [0.0, 8e-11, 8e-10, 8e-9, 1.6e-8]
MS = [0.0, 4e3, 4e6, 1e8]
NS = list(range(1, 17)) + [32, 64]
CS = [0.0, 0.001, 0.01, 0.1, 1.0]


def _decided(x: float, y: float) -> bool:
    """False when x and y are equal up to rounding, where closed form and direct comparison may
    legitimately land on different sides (exact ties are tested separately with exact values)."""
    return abs(x - y) > 1e-9 * max(abs(x), abs(y))


def test_rules_agree_with_direct_comparison_over_grid() -> None:
    checked = {"5a": 0, "5b": 0, "5c": 0, "choice": 0}
    for a, b, M, N, c in itertools.product(ALPHAS, BETAS, MS, NS, CS):
        ag, ring, tree = _ag(a, b, M, N, c), _ring(a, b, M, N, c), _tree(a, b, M, N, c)
        for name, rule, lhs, rhs in (
            ("5a", cm.rule_5a_ring_over_tree, ring, tree),
            ("5b", cm.rule_5b_ring_over_allgather, ring, ag),
            ("5c", cm.rule_5c_tree_over_allgather, tree, ag),
        ):
            if _decided(lhs, rhs):
                assert rule(a, b, M, N, c) == (lhs < rhs), (name, a, b, M, N, c, lhs, rhs)
                checked[name] += 1
            elif lhs == rhs == 0:  # nothing to send: no strict win
                assert rule(a, b, M, N, c) is False, (name, a, b, M, N, c)
        costs = {"allgather": ag, "art_ring": ring, "art_tree": tree}
        best = min(costs.values())
        winners = [k for k, v in costs.items() if not _decided(v, best)]
        if len(winners) == 1:
            assert cm.choose_sparse_collective(a, b, M, N, c) == winners[0], (a, b, M, N, c, costs)
            assert cm.choose_sparse_collective_by_rules(a, b, M, N, c) == winners[0], (a, b, M, N, c, costs)
            checked["choice"] += 1
        assert cm.sparse_collective_costs(a, b, M, N, c) == pytest.approx(costs, rel=1e-12, abs=0)
    # the grid must actually exercise every rule on both sides of its boundary
    assert min(checked.values()) > 1000, checked
    outcomes = {cm.choose_sparse_collective(a, b, M, N, c)
                for a, b, M, N, c in itertools.product(ALPHAS, BETAS, MS, NS, CS)}
    assert outcomes == {"allgather", "art_ring", "art_tree"}


def test_closed_form_coefficients_match_paper_expressions() -> None:
    for N in range(4, 65):
        L = _L(N)
        assert cm.rule_5a_coefficient(N) == pytest.approx((L - (N - 1) / N) / (N - 1 - L))
        assert cm.rule_5b_coefficient(N) == pytest.approx(1 - 1 / N - L / (2 * (N - 1)))
        assert cm.rule_5c_coefficient(N) == pytest.approx((N - 1) / L - 1.5)
        assert cm.rule_5a_coefficient(N) > 0 and cm.rule_5b_coefficient(N) > 0
    # degenerate denominators / signs, as documented: at N = 2 and 3 the alpha terms of 4a and 4b
    # are equal (2(N-1) + L == 3L), so the ring wins whenever anything is sent
    assert cm.rule_5a_coefficient(2) == cm.rule_5a_coefficient(3) == math.inf
    assert cm.rule_5c_coefficient(5) < 0 < cm.rule_5c_coefficient(6)
    assert all(math.isnan(f(1)) for f in (cm.rule_5a_coefficient, cm.rule_5b_coefficient, cm.rule_5c_coefficient))
    assert cm.rule_5b_coefficient(2) == 0.0
    assert cm.rule_5c_coefficient(2) < 0 and cm.rule_5c_coefficient(3) < 0 and cm.rule_5c_coefficient(4) == 0.0
    assert cm.rule_5c_coefficient(5) < 0  # L = 3 at N = 5: (5-1)/3 - 3/2 < 0


def test_exact_ties_and_degenerate_settings() -> None:
    # values chosen so that every product is exact in binary floating point
    # N = 2: ring - tree = -M*c*beta, so the ring wins for any alpha once M*c*beta > 0 ...
    assert cm.rule_5a_ring_over_tree(1e3, 0.5, 8.0, 2, 0.25) is True
    # ... and ties with the tree when beta = 0 (tie -> not strictly cheaper)
    assert cm.rule_5a_ring_over_tree(1.0, 0.0, 8.0, 2, 0.25) is False
    # N = 2, alpha = 0: ring == allgather exactly (K_5b = 0) -> allgather (tie order)
    assert _ring(0.0, 0.5, 8.0, 2, 0.25) == _ag(0.0, 0.5, 8.0, 2, 0.25) == 2.0
    assert cm.rule_5b_ring_over_allgather(0.0, 0.5, 8.0, 2, 0.25) is False
    assert cm.choose_sparse_collective(0.0, 0.5, 8.0, 2, 0.25) == "allgather"
    assert cm.choose_sparse_collective_by_rules(0.0, 0.5, 8.0, 2, 0.25) == "allgather"
    # N = 4, alpha = 0: tree == allgather exactly (K_5c = 0) -> rule 5c says no
    assert _tree(0.0, 0.5, 8.0, 4, 0.25) == _ag(0.0, 0.5, 8.0, 4, 0.25) == 6.0
    assert cm.rule_5c_tree_over_allgather(0.0, 0.5, 8.0, 4, 0.25) is False
    # N = 1: nothing is sent; every cost is 0 and allgather is chosen
    assert cm.sparse_collective_costs(1e-3, 1e-9, 1e8, 1, 0.1) == {"allgather": 0, "art_ring": 0, "art_tree": 0}
    assert cm.choose_sparse_collective(1e-3, 1e-9, 1e8, 1, 0.1) == "allgather"
    assert cm.choose_sparse_collective_by_rules(1e-3, 1e-9, 1e8, 1, 0.1) == "allgather"
    # alpha = beta = 0: all zero -> allgather
    assert cm.choose_sparse_collective(0.0, 0.0, 1e8, 8, 0.1) == "allgather"
    # N = 8, alpha = (3 - 7/8)/(7 - 3) * M*c*beta = 17 with M*c*beta = 32: ART-Ring == ART-Tree == 441
    # exactly and allgather costs 499 -> the tree (rule 5a is strict)
    args = (17.0, 1.0, 128.0, 8, 0.25)
    assert _ring(*args) == _tree(*args) == 441.0 and _ag(*args) == 499.0
    assert cm.rule_5a_ring_over_tree(*args) is False
    assert cm.choose_sparse_collective(*args) == "art_tree"
    assert cm.choose_sparse_collective_by_rules(*args) == "art_tree"
    assert cm.SPARSE_COLLECTIVE_TIE_ORDER == ("allgather", "art_tree", "art_ring")


def test_network_model_validation_and_helpers() -> None:
    net = NetworkModel(alpha_s=2e-5, beta_s_per_byte=1e-9)
    assert net.bandwidth_bits_per_s == pytest.approx(8e9)
    assert NetworkModel(0.0, 0.0).bandwidth_bits_per_s == math.inf
    assert net.ring_allreduce(4e6, 4) == pytest.approx(6 * 2e-5 + 1.5 * 4e6 * 1e-9)
    assert net.tree_allreduce(4e6, 4) == pytest.approx(4 * 2e-5 + 4 * 4e6 * 1e-9)
    with pytest.raises(ValueError, match=r"alpha_s=-1.*>= 0"):
        NetworkModel(-1.0, 1e-9)
    with pytest.raises(ValueError, match=r"beta_s_per_byte=nan"):
        NetworkModel(1e-4, float("nan"))
    with pytest.raises(TypeError, match=r"alpha_s='fast' is not a number"):
        NetworkModel("fast", 1e-9)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"bits_per_s=0.*must be > 0"):
        NetworkModel.from_bandwidth(0, 1e-3)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"N": 0}, r"N=0 must be an integer >= 1"),
        ({"N": 2.5}, r"N=2.5 must be an integer >= 1"),
        ({"c": 5.0}, r"c=5.0 must be at most 1.*fraction"),
        ({"c": -0.1}, r"c=-0.1 must be a finite number >= 0"),
        ({"M": -4}, r"M=-4 must be a finite number >= 0"),
        ({"alpha": math.inf}, r"alpha=inf must be a finite number >= 0"),
        ({"beta": -1e-9}, r"beta=-1e-09 must be a finite number >= 0"),
    ],
)
def test_invalid_inputs_are_named(kwargs: dict, match: str) -> None:
    args = {"alpha": 1e-4, "beta": 1e-9, "M": 4e6, "N": 4, "c": 0.01, **kwargs}
    with pytest.raises(ValueError, match=match):
        cm.choose_sparse_collective(**args)


def test_rounds_are_ceil_log2_between_powers_of_two() -> None:
    # what runs: a binomial tree over N ranks has ceil(log2 N) rounds (counted by hand here)
    for N, rounds in [(1, 0), (2, 1), (3, 2), (4, 2), (5, 3), (8, 3), (9, 4), (17, 5)]:
        assert cm.tree_rounds(N) == rounds
    # N = 5: broadcast 3 rounds, tree allreduce 2 * 3 rounds of the full message
    assert cm.broadcast_cost(1.0, 0.5, 8.0, 5) == 3 * (1 + 8 * 0.5)
    assert cm.tree_allreduce_cost(1.0, 0.5, 8.0, 5) == 6 * (1 + 8 * 0.5)


def test_fp16_values_with_int32_indices_hand_computed() -> None:
    # numel = 1000 fp16 elements, c = 0.1: k = 100, index bytes I = 4*100 = 400, value bytes
    # V = 2*100 = 200; alpha = 1e-3, beta = 1e-6, N = 4 (L = 2)
    a, b, N, c = 1e-3, 1e-6, 4, 0.1
    M = 4 * 1000
    idx_b, val_b = 400.0, 200.0
    ag = a * 2 + (idx_b + val_b) * b * 3
    ring = a * (2 * 3 + 2) + b * (idx_b * 2 + val_b * 2 * 3 / 4)
    tree = 3 * a * 2 + b * 2 * (idx_b + 2 * val_b)
    got = cm.sparse_collective_costs(a, b, M, N, c, value_bytes=2)
    assert got == pytest.approx({"allgather": ag, "art_ring": ring, "art_tree": tree}, rel=1e-12)
    # the fp16 allgather moves 600 bytes per rank, not 400 (M = numel * element_size undercounted
    # the indices) and not 800 (fp32 values)
    assert got["allgather"] - a * 2 == pytest.approx(600 * b * 3)
    with pytest.raises(ValueError, match="value_bytes"):
        cm.sparse_allgather_cost(a, b, M, N, c, value_bytes=0)


def test_auto_exchange_predicts_fp16_cost_by_hand() -> None:
    from lightning_gc.compressors import GroupContext, build_compressor
    from lightning_gc.exchanges.artopk import AutoSparseExchange, NetworkState

    a, b, N, c, numel = 1e-3, 1e-6, 4, 0.1, 1000
    ex = AutoSparseExchange(build_compressor("artopk_auto", ratio=c), None, NetworkState(NetworkModel(a, b), True))
    ctx = GroupContext(step=3, rank=0, world_size=N, segments=(numel,), group_id=0, seed=0)
    choice, predicted = ex.choose(ctx, element_size=2)
    by_hand = {"allgather": a * 2 + (400 + 200) * b * 3,
               "art_ring": a * 8 + b * (400 * 2 + 200 * 1.5),
               "art_tree": 6 * a + b * 2 * (400 + 400)}
    assert choice == min(by_hand, key=by_hand.get) == "allgather"
    assert predicted == pytest.approx(by_hand["allgather"], rel=1e-12)
    # fp32 gradient of the same numel: values 400 bytes
    _, predicted32 = ex.choose(ctx, element_size=4)
    assert predicted32 == pytest.approx(a * 2 + 800 * b * 3, rel=1e-12)
