"""The held-out study workload (docs/studies/heldout_encoder.py) that the per-step-best clause of
docs/auto-diloco.md is measured on: its labels are the teacher's, by a hand loop; its data are the
same on every build; the bench loads it as a ``module:factory`` preset; it trains."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

STUDIES = Path(__file__).resolve().parents[1] / "docs" / "studies"


@pytest.fixture(scope="module")
def heldout():
    sys.path.insert(0, str(STUDIES))
    try:
        import heldout_encoder
        yield heldout_encoder
    finally:
        sys.path.remove(str(STUDIES))


def _hand_labels(x: torch.Tensor, table: torch.Tensor, centre: torch.Tensor) -> tuple[list[int], list[float]]:
    labels, margins = [], []
    for row in x.tolist():
        scores = [sum(float(table[a, b, c]) for a, b in zip(row[:-1], row[1:])) - float(centre[c])
                  for c in range(table.shape[2])]
        ranked = sorted(scores, reverse=True)
        labels.append(max(range(len(scores)), key=scores.__getitem__))
        margins.append(ranked[0] - ranked[1])
    return labels, margins


def test_labels_are_the_teachers_by_hand(heldout):
    data = heldout.BigramTeacherData(num_train=64, num_val=32, seed=3)
    table, centre, threshold = data._teacher_params()
    for split in ("train", "val"):
        x, y = data.generate(split)
        labels, margins = _hand_labels(x, table, centre)
        assert y.tolist() == labels
        assert min(margins) >= threshold - 1e-9
    assert threshold > 0


def test_data_is_deterministic_and_splits_differ(heldout):
    a = heldout.BigramTeacherData(num_train=256, num_val=64, seed=1)
    b = heldout.BigramTeacherData(num_train=256, num_val=64, seed=1)
    xa, ya = a.generate("train")
    xb, yb = b.generate("train")
    assert torch.equal(xa, xb) and torch.equal(ya, yb)
    assert not torch.equal(a.generate("val")[0], xa[:64])
    counts = torch.bincount(ya, minlength=4)
    assert counts.min() > 256 // 4 // 3, counts  # centring keeps the classes near balance


def test_bench_loads_it_and_it_trains(heldout):
    from lightning_gc.bench.workloads import resolve_preset

    sys.path.insert(0, str(STUDIES))
    try:
        w = resolve_preset("heldout_encoder:workload", seed=0, d_model=32, n_layers=1)
    finally:
        sys.path.remove(str(STUDIES))
    assert (w.metric, w.mode, w.target, w.batch_size) == ("val_acc", "max", 0.8, 32)
    w.datamodule.hparams.num_train = 512
    w.datamodule.setup()
    model = w.model
    opt = model.configure_optimizers()["optimizer"]
    x, y = w.datamodule.train_set.tensors
    first = F.cross_entropy(model(x), y).item()
    for _ in range(30):
        opt.zero_grad()
        F.cross_entropy(model(x[:128]), y[:128]).backward()
        opt.step()
    assert F.cross_entropy(model(x[:128]), y[:128]).item() < first


def test_bad_arguments_are_refused(heldout):
    with pytest.raises(ValueError, match="multiple of n_heads"):
        heldout.EncoderClassifier(d_model=30, n_heads=4)
    with pytest.raises(ValueError, match="margin_quantile"):
        heldout.BigramTeacherData(margin_quantile=1.0)
