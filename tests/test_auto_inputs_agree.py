"""A rank disagreement in ``auto``'s inputs, met in a real decision (issue class 6).

A figure that reaches one rank's decision without being agreed makes the ranks choose differently and
then issue different collectives: a gloo abort or a hang. Here one rank's measured errors are changed
after their agreement (a stand-in for a forgotten agreement), in a real 2-rank Trainer run with
``compressor="auto"``. Every rank must stop with the same clear error naming the value on each rank;
the oracle is the perturbation itself: rank 1's figure is rank 0's × 1.5, as planted.
"""

from __future__ import annotations

import os
import re
import sys
from dataclasses import replace

import lightning as L
import pytest
from auto_lit import SLOW_LINK
from dist_harness import run_distributed

from lightning_gc import GCStrategy

FACTOR = 1.5


def _plant_rank_local_errors() -> None:
    """Multiply every measured candidate error by :data:`FACTOR` after its agreement, in every
    ``lightning_gc.auto`` module that uses ``measure_costs``."""
    for name, module in list(sys.modules.items()):
        original = getattr(module, "measure_costs", None)
        if name.startswith("lightning_gc.auto") and callable(original):
            def planted(*args, _original=original, **kwargs):
                return [replace(c, delta2=c.delta2 * FACTOR) for c in _original(*args, **kwargs)]
            module.measure_costs = planted


def _fit_rank(rank: int, world_size: int, tmp: str) -> str | None:
    from lit_models import TinyClassifier, make_loader

    os.environ.update(LOCAL_RANK=str(rank), RANK=str(rank), NODE_RANK="0", WORLD_SIZE=str(world_size))
    if rank == 1:
        _plant_rank_local_errors()
    L.seed_everything(0, verbose=False)
    # the ranks exist already (this process group): the strategy starts none
    strategy = GCStrategy(compressor="auto", min_compress_numel=16, **SLOW_LINK,
                          auto={"candidates": ["ddp", "topk", "efsign"], "window": 1000, "probe_every": 0,
                                "early_comm_ratio": 0.0})
    trainer = L.Trainer(strategy=strategy, accelerator="cpu", devices=2,
                        max_steps=6, logger=False, enable_progress_bar=False, enable_model_summary=False,
                        enable_checkpointing=False, default_root_dir=tmp)
    try:
        trainer.fit(TinyClassifier(), make_loader(seed=rank))  # rank-dependent batches: the errors differ
    except Exception as e:  # noqa: BLE001 - the message is what the test checks
        return f"{type(e).__name__}: {e}"
    return None


def test_an_unagreed_error_stops_every_rank_with_the_value_on_each_rank(tmp_path):
    messages = run_distributed(_fit_rank, 2, str(tmp_path), timeout=240)
    assert messages[0] is not None and messages[0] == messages[1], "both ranks stop on the same check, no hang"
    assert messages[0].startswith("InputsDisagree: ") and "the warmup decision at step" in messages[0]
    number = r"(-?\d+(?:\.\d+)?(?:e[-+]?\d+)?)"
    named = re.findall(rf"delta2\[(\w+)\]: rank 0 = {number}, rank 1 = {number}", messages[0])
    # ddp's error is 0 on both ranks (0 × 1.5 = 0): only the lossy candidates are named, each planted × 1.5
    assert sorted(n for n, _, _ in named) == ["efsign", "topk"]
    for _, r0, r1 in named:
        assert float(r1) == pytest.approx(FACTOR * float(r0), rel=1e-12) and float(r0) > 0
