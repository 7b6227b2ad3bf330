"""The composition matrix under pytest (see tests/composition.py for the factors, the design and
the refusal table; docs/concepts.md for the table in prose).

The suite runs a cheap subset that reaches every kind of verdict (trains fresh, trains resumed with
state carried by OSP and the controller, trains by nodes on 4 ranks, refused for each reason);
``pytest -m matrix`` runs the whole design (all pairs + the full product of the stateful factors,
twice, + the cases of auto, options, lowbit and the topology), 159 cases, 150 of them on 2 ranks
and 9 on 4 (2 nodes of 2). The refusals ``topology="nodes"`` makes at construction are also checked
here without processes, against the same table.
"""

from __future__ import annotations

import itertools
import re

import pytest
from composition import (
    COLLECTIVE_OF,
    FACTORS,
    _strategy,
    all_pairs,
    case_id,
    check_case,
    design,
    expected_refusal,
    known_inexact,
    world,
)

SUBSET = [
    {"compressor": "auto", "sync": "bsp", "plan": "model", "controller": "none", "accumulate": 2,
     "precision": "32-true", "optimizer": "adamw_clip", "resume": "resumed", "topology": "flat",
     "auto_options": {"diloco": ["diloco2"], "diloco_gate": 0, "diloco_lead": 0, "diloco_rounds": 1,
                      "diloco_threshold": 1e9}},
    {"compressor": "topk", "sync": "osp", "plan": "model", "controller": "rollback", "accumulate": 1,
     "precision": "32-true", "optimizer": "adamw_clip", "resume": "resumed", "topology": "flat"},
    {"compressor": "efsignsgd", "sync": "bsp", "plan": "omgs", "controller": "none", "accumulate": 2,
     "precision": "bf16-mixed", "optimizer": "sgd", "resume": "resumed", "topology": "flat"},
    {"compressor": "qsgd", "sync": "bsp", "plan": "layer", "controller": "shadow", "accumulate": 1,
     "precision": "32-true", "optimizer": "sgd", "resume": "fresh", "topology": "flat"},
    {"compressor": "marsit", "sync": "osp", "plan": "omgs", "controller": "none", "accumulate": 1,
     "precision": "32-true", "optimizer": "sgd", "resume": "fresh", "topology": "flat"},
    {"compressor": "star_topk", "sync": "bsp", "plan": "omgs", "controller": "none", "accumulate": 2,
     "precision": "32-true", "optimizer": "sgd", "resume": "fresh", "topology": "flat"},
    {"compressor": "qsgd", "sync": "diloco", "plan": "layer", "controller": "none", "accumulate": 2,
     "precision": "bf16-mixed", "optimizer": "sgd", "resume": "resumed", "topology": "flat"},
    {"compressor": "auto", "sync": "bsp", "plan": "model", "controller": "none", "accumulate": 2,
     "precision": "bf16-mixed", "optimizer": "adamw_clip", "resume": "resumed", "topology": "flat",
     "auto_options": {"gain_every": 3, "gain_drift": 0.0, "early_comm_ratio": 1e-9, "compute_shift": False,
                      "gain_every_max": 6}},
    # by nodes, 2 of 2 ranks: the node's reduce-scatter, lowbit's ring on each shard's group, accumulation, resume
    {"compressor": "lowbit", "sync": "bsp", "plan": "layer", "controller": "none", "accumulate": 2,
     "precision": "32-true", "optimizer": "sgd", "resume": "resumed", "topology": "nodes", "world": 4},
]
# Left to the full design (pytest -m matrix) to keep the suite under 15 minutes, because other suite
# tests resume the same state: OSP + AdamW + clipping + accumulation + bf16 (tests/test_osp_lightning.py
# resumes AdamW + clipping + bf16) and lowrank with the layer plan (tests/test_lowrank.py: the engine
# recursion; the auto case above resumes engine slots).


def test_the_design_covers_every_pair_and_the_stateful_product():
    names = list(FACTORS)
    cases = design()
    covered = {(a, c[a], b, c[b]) for c in cases for a, b in itertools.combinations(names, 2)}
    needed = {(a, va, b, vb) for a, b in itertools.combinations(names, 2) for va in FACTORS[a] for vb in FACTORS[b]}
    assert needed <= covered
    stateful = {tuple(c[n] for n in ("controller", "sync", "plan", "resume")) for c in cases}
    assert len(stateful) == 3 * 3 * 3 * 2
    adamw = {tuple(c[n] for n in ("controller", "sync", "plan", "resume")) for c in cases
             if c["optimizer"] == "adamw_clip" and c["sync"] in ("osp", "diloco")}
    assert len(adamw) == 3 * 2 * 3 * 2  # the stateful product again with AdamW + clipping under OSP and DiLoCo
    assert len(all_pairs(FACTORS)) < 40  # a few dozen, not the 4536 of the full product


def test_refusal_table_has_a_reason_for_each_kind():
    kinds = {expected_refusal(c) for c in design()}
    assert None in kinds and len(kinds) >= 4


def test_each_node_refusal_is_met_alone_and_what_trains_by_nodes_is_paired_on_4_ranks():
    """Every reason of ``hierarchy.refusal`` is the verdict of some case (so removing any one of them
    fails the matrix), each refused collective among them; what trains by nodes runs on 4 ranks with
    every pair of its values, and each of the compressors it takes trains on 2 ranks too."""
    nodes = [c for c in design() if c["topology"] == "nodes"]
    met = {expected_refusal(c) for c in nodes}
    for reason in ("compressor='auto'", "sync='osp'", "sync='diloco'", "plan='omgs'", "the AdaptiveRatio callback",
                   *(f"collective='{COLLECTIVE_OF[c]}'" for c in ("star_topk", "marsit", "gradiveq", "lowrank"))):
        assert any(m and m.startswith(f"topology='nodes' with {reason}") for m in met), reason
    trains = [c for c in nodes if expected_refusal(c) is None]
    assert {c["compressor"] for c in trains if world(c) == 2} == {"topk", "qsgd", "efsignsgd", "lowbit"}
    four = [c for c in trains if world(c) == 4]
    names = ("compressor", "plan", "accumulate", "precision", "optimizer", "resume")
    covered = {(a, c[a], b, c[b]) for c in four for a, b in itertools.combinations(names, 2)}
    values = {"compressor": ("topk", "qsgd", "efsignsgd", "lowbit"), "plan": ("model", "layer")}
    needed = {(a, va, b, vb) for a, b in itertools.combinations(names, 2)
              for va in values.get(a, FACTORS[a]) for vb in values.get(b, FACTORS[b])}
    assert needed <= covered, sorted(needed - covered)


def test_lowbit_trains_flat_with_every_sync_and_plan_it_composes_with():
    got = {(c["sync"], c["plan"]) for c in design() if c["compressor"] == "lowbit" and c["topology"] == "flat"
           and expected_refusal(c) is None}
    assert got == {("bsp", "model"), ("bsp", "layer"), ("bsp", "omgs"), ("osp", "model"), ("osp", "layer"),
                   ("diloco", "model"), ("diloco", "layer")}


@pytest.mark.parametrize("compressor", [*FACTORS["compressor"], "fp16"])
def test_node_refusals_at_construction_match_the_table(compressor):
    """``GCStrategy(...)`` by nodes, built as the matrix builds it, for every sync × plan: refused with
    the table's message exactly where the table says (the controller's refusal comes at fit start and
    is met by the matrix's runs)."""
    base = {n: v[0] for n, v in FACTORS.items()}
    for sync, plan in itertools.product(FACTORS["sync"], FACTORS["plan"]):
        case = {**base, "compressor": compressor, "sync": sync, "plan": plan, "topology": "nodes"}
        want = expected_refusal(case)
        try:
            _strategy(case)
            got = None
        except ValueError as e:
            got = str(e)
        if want is None:
            assert got is None, (case_id(case), got)
        else:
            assert got is not None and re.search(want, got, re.S), (case_id(case), want, got)


@pytest.mark.slow
@pytest.mark.parametrize("case", SUBSET, ids=case_id)
def test_composition_subset(case, tmp_path):
    assert check_case(case, str(tmp_path)) == _verdict(case)


@pytest.mark.matrix
@pytest.mark.parametrize("case", design(), ids=case_id)
def test_composition_matrix(case, tmp_path):
    assert check_case(case, str(tmp_path)) == _verdict(case)


def _verdict(case) -> str:
    if expected_refusal(case):
        return "refused"
    return "trains (resume inexact: known)" if known_inexact(case) else "trains"
