"""The composition matrix under pytest (see tests/composition.py for the factors, the design and
the refusal table; docs/concepts.md for the table in prose).

The suite runs a cheap subset that reaches every kind of verdict (trains fresh, trains resumed with
state carried by OSP and the controller, refused for each reason); ``pytest -m matrix`` runs the
whole design (all pairs + the full product of the stateful factors, twice), 112 cases × 2 ranks.
"""

from __future__ import annotations

import pytest
from composition import FACTORS, all_pairs, case_id, check_case, design, expected_refusal, known_inexact

SUBSET = [
    {"compressor": "topk", "sync": "osp", "plan": "model", "controller": "rollback", "accumulate": 1,
     "precision": "32-true", "optimizer": "adamw_clip", "resume": "resumed"},
    {"compressor": "efsignsgd", "sync": "bsp", "plan": "omgs", "controller": "none", "accumulate": 2,
     "precision": "bf16-mixed", "optimizer": "sgd", "resume": "resumed"},
    {"compressor": "qsgd", "sync": "bsp", "plan": "layer", "controller": "shadow", "accumulate": 1,
     "precision": "32-true", "optimizer": "sgd", "resume": "fresh"},
    {"compressor": "marsit", "sync": "osp", "plan": "omgs", "controller": "none", "accumulate": 1,
     "precision": "32-true", "optimizer": "sgd", "resume": "fresh"},
    {"compressor": "star_topk", "sync": "bsp", "plan": "omgs", "controller": "none", "accumulate": 2,
     "precision": "32-true", "optimizer": "sgd", "resume": "fresh"},
    {"compressor": "qsgd", "sync": "diloco", "plan": "layer", "controller": "none", "accumulate": 2,
     "precision": "bf16-mixed", "optimizer": "sgd", "resume": "resumed"},
    {"compressor": "auto", "sync": "bsp", "plan": "model", "controller": "none", "accumulate": 2,
     "precision": "bf16-mixed", "optimizer": "adamw_clip", "resume": "resumed",
     "auto_options": {"gain_every": 3, "gain_drift": 0.0, "early_comm_ratio": 1e-9, "compute_shift": False,
                      "gain_every_max": 6}},
]
# Left to the full design (pytest -m matrix) to keep the suite under 15 minutes, because other suite
# tests resume the same state: OSP + AdamW + clipping + accumulation + bf16 (tests/test_osp_lightning.py
# resumes AdamW + clipping + bf16) and lowrank with the layer plan (tests/test_lowrank.py: the engine
# recursion; the auto case above resumes engine slots).


def test_the_design_covers_every_pair_and_the_stateful_product():
    import itertools

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
