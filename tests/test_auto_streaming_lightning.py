"""``compressor="auto"`` switching a real Lightning run into Streaming DiLoCo and back (2 spawned
CPU/gloo ranks, rank-dependent data): the candidate ``diloco10f2`` (H 10, 2 fragments, each exchange
overlapped with the next 2 inner steps on a worker thread). The ranks are bit-identical wherever a
per-step method runs, the inner optimizer state too, and a resume from a checkpoint written with a
fragment's exchange in flight ends bit-identical to the uninterrupted run.

The switches are pinned as in tests/test_auto_diloco_lightning.py (tests/auto_family_lit.py): the
incumbent's window 3-12, Streaming DiLoCo entered at the end of 12 (13 steps done, its first round
shortened to 7 so the rounds end on multiples of 10), left at the end of 19. With the schedule moved
by −3, fragment 0 is sent after inner step 2 (step 14) and applied after step 4 (16); fragment 1 is
sent after step 7, the window's last (19), where leaving applies it and closes fragment 0 as well.
"""

from __future__ import annotations

import lightning as L
import pytest
import torch
from auto_family_lit import fit, strategy

pytestmark = pytest.mark.slow

ENTER, LEAVE = 12, 19


def _steps(report: dict) -> list[tuple[str, int, str | None]]:
    return [(e["event"], e["step"], e.get("choice", e.get("winner"))) for e in report["sync"]["events"]]


def _streaming(**kw):
    return strategy(diloco=["diloco10f2"], diloco_threshold=1e9, **kw)


def test_switching_to_streaming_diloco_and_back_keeps_the_ranks_identical_outside_it(tmp_path):
    res = fit(tmp_path, _streaming())
    assert _steps(res[0]) == [("trial", 2, None), ("enter", ENTER, "diloco10f2"), ("leave", LEAVE, "diloco10f2"),
                              ("verdict", 29, "incumbent")]
    assert res[0]["sync"] == res[1]["sync"]
    runs = [s["diloco"] for s in res[0]["steps"]]
    assert runs == [False] * ENTER + [True] * (LEAVE - ENTER) + [False] * (len(runs) - LEAVE)
    a, b = res[0]["steps"], res[1]["steps"]
    for step in range(len(runs)):
        inside = ENTER < step < LEAVE  # some fragment has inner steps not yet closed
        same = torch.equal(a[step]["params"], b[step]["params"])
        assert same != inside, f"step {step}: ranks {'identical' if same else 'differ'}"
        same = all(torch.equal(x, y) for x, y in zip(a[step]["moments"], b[step]["moments"]))
        assert same != inside, f"step {step}: momentum {'identical' if same else 'differs'}"
    # fragment 0 (the first layer's weight) applied after step 16 with α = 0: equal to θ_outer on both
    # ranks then, while fragment 1 has its own inner steps on each
    w1 = 16 * 96
    assert torch.equal(a[16]["params"][:w1], b[16]["params"][:w1])
    assert not torch.equal(a[16]["params"][w1:], b[16]["params"][w1:])
    assert not torch.equal(a[15]["params"][:w1], b[15]["params"][:w1])


def test_resume_from_a_checkpoint_written_with_a_fragment_in_flight_is_exact(tmp_path):
    """The checkpoint after epoch 0 (16 steps: after step 15, inner step 3) holds fragment 0's exchange,
    sent after step 14 and due after step 16."""
    ckpt_cb = L.pytorch.callbacks.ModelCheckpoint(dirpath=str(tmp_path / "ckpt"), save_top_k=-1, every_n_epochs=1)
    full = fit(tmp_path / "a", _streaming(), callbacks=[ckpt_cb], enable_checkpointing=True)
    ckpt_file = sorted((tmp_path / "ckpt").glob("epoch=0*.ckpt"))[0]
    shared = torch.load(ckpt_file, weights_only=False)["lightning_gc"]["diloco/shared"]
    assert shared["active"] and shared["choice"] == "diloco10f2"
    assert {p: (j["sent_at"], j["due"]) for p, j in shared["pending"].items()} == {0: (2, 4)}
    resumed = fit(tmp_path / "b", _streaming(), ckpt_path=str(ckpt_file))
    for r in range(2):
        assert _steps(resumed[r]) == _steps(full[r])
        for k, v in full[r]["params"].items():
            assert torch.equal(v, resumed[r]["params"][k]), f"rank {r} {k} differs after resume"
        for k, v in full[r]["optimizer"]["state"].items():
            assert torch.equal(v["momentum_buffer"], resumed[r]["optimizer"]["state"][k]["momentum_buffer"])
