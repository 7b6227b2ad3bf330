"""auto's DiLoCo candidate names (lightning_gc/auto/diloco_candidates.py): what each name runs and
what the cost model is told about it.

Oracles: a table of names and the H, Δ form, fragments F and overlap τ each must mean, written out by
hand (τ defaults to half the steps between two fragments' sends); fragment shares of small models
worked out by hand from DiLoCo's cut rule (a new fragment where the running count first reaches k/F).
"""

from __future__ import annotations

import pytest

from lightning_gc.auto.config import AutoConfig
from lightning_gc.auto.diloco_candidates import diloco_choice


@pytest.mark.parametrize("name, h, delta, f, tau", [
    ("diloco10", 10, "fp16", 1, 0),
    ("sparseloco50", 50, "sparseloco", 1, 0),
    ("diloco50f5", 50, "fp16", 5, 5),  # 10 steps between sends: τ = 5
    ("diloco10f2", 10, "fp16", 2, 2),  # 5 steps between sends: τ = 2
    ("diloco7f3", 7, "fp16", 3, 1),  # 2 steps between sends: τ = 1
    ("diloco10f10", 10, "fp16", 10, 0),  # 1 step between sends: no room to overlap
    ("diloco50f5t2", 50, "fp16", 5, 2),
    ("diloco50f5t0", 50, "fp16", 5, 0),
    ("diloco50t20", 50, "fp16", 1, 20),  # the whole model, overlapped
    ("sparseloco50f5", 50, "sparseloco", 5, 5),
])
def test_a_name_means_its_h_form_fragments_and_overlap(name, h, delta, f, tau):
    c = diloco_choice(name)
    assert (c.inner_steps, c.delta, c.fragments, c.overlap_steps) == (h, delta, f, tau)
    cfg = c.config()
    assert (cfg.inner_steps, cfg.fragments, cfg.overlap_steps, cfg.mixing) == (h, f, tau, 0.0)
    assert cfg.compressor == ("sparseloco" if delta == "sparseloco" else None)


@pytest.mark.parametrize("name, match", [
    ("diloco10f11", r"F = 11 .*F ≤ H"),
    ("diloco10f2t5", r"τ = 5 .*τ < H/F"),
    ("diloco50t50", r"τ = 50"),
    ("diloco0", "not a DiLoCo candidate"),
    ("diloco10f0", "not a DiLoCo candidate"),
    ("dilocof2", "not a DiLoCo candidate"),
    ("diloco10t2f2", "not a DiLoCo candidate"),  # f before t
    ("diloco10x", "f<fragments>"),
])
def test_bad_names_are_refused_with_the_grammar(name, match):
    with pytest.raises(ValueError, match=match):
        diloco_choice(name)
    with pytest.raises(ValueError, match=match):  # and when the config is built, before any process starts
        AutoConfig(diloco=(name,))


def test_shares_follow_dilocos_cut_of_whole_tensors():
    # [100, 300, 600], F = 2: tensor 1 joins fragment 0 (400 < 500), tensor 2 must open fragment 1
    assert diloco_choice("diloco10f2").shares([100, 300, 600]) == (0.4, 0.6)
    # [500, 100, 100, 300], F = 2: fragment 0 reaches half at tensor 0; the rest is fragment 1
    assert diloco_choice("diloco10f2").shares([500, 100, 100, 300]) == (0.5, 0.5)
    assert diloco_choice("diloco10").shares([100, 300, 600]) == ()
    cost = diloco_choice("diloco50f5t3").cost([10] * 10)
    assert (cost.inner_steps, cost.fragments, cost.overlap_steps, cost.shares) == (50, 5, 3, (0.2,) * 5)
    assert (cost.delta_bytes_per_element, cost.wire) == (2.0, "allreduce")
    sparse = diloco_choice("sparseloco50f5").cost([1000] * 10)
    assert sparse.wire == "allgather" and sparse.fragments == 5 and sparse.delta_bytes_per_element < 0.1


def test_more_fragments_than_tensors_is_refused_with_a_name_that_fits():
    with pytest.raises(ValueError, match=r"'diloco50f5' cuts the model into 5 fragments, but it has 3 .*'diloco50f3'"):
        diloco_choice("diloco50f5").check_model([10, 20, 30])
    diloco_choice("diloco50f3").check_model([10, 20, 30])
