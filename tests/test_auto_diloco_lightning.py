"""``compressor="auto"`` switching a real Lightning run between per-step DDP and DiLoCo and back (2
spawned CPU/gloo ranks, rank-dependent data): the ranks are bit-identical whenever a per-step method
runs, the inner optimizer state too, and a resume from a checkpoint written while DiLoCo runs ends
bit-identical to the uninterrupted run.

The switches are made deterministic, not timed: a pinned link and ``ddp`` as the only per-step
candidate fix the first decision, ``diloco_gate=0`` starts the trial right after it, and
``diloco_threshold=1e9`` makes the verdict the bracketing family's: per-step first (``diloco_lead=0``),
every run enters DiLoCo after the incumbent's window and leaves it after its own; DiLoCo first, it
enters as the trial starts and keeps DiLoCo (tests/test_sync_switch.py drives the verdicts).
"""

from __future__ import annotations

import lightning as L
import pytest
import torch
from auto_family_lit import fit, strategy

from lightning_gc.sync.diloco import LEAVE_WIRE_DTYPE

pytestmark = pytest.mark.slow

# warm-up steps 0-1 (decision at 1); the trial starts at 2: the incumbent's window 3-12, DiLoCo's 13-19
# (entered at the end of 12, 13 steps done; its round runs to the next multiple of H = 10, 7 steps, and is
# closed and left at the end of 19), the incumbent again 20-29
TRIAL, ENTER, LEAVE, VERDICT = 2, 12, 19, 29
# DiLoCo first: entered at the end of 2 (3 done), its round of 7 to 10 done, left at the end of 9; the
# per-step window 10-19; DiLoCo entered again at the end of 19 (20 done, a whole round), the verdict at 29
D_ENTER, D_LEAVE, D_BACK, D_VERDICT = 2, 9, 19, 29


def _steps(report: dict) -> list[tuple[str, int, str | None]]:
    return [(e["event"], e["step"], e.get("choice", e.get("winner"))) for e in report["sync"]["events"]]


def test_switching_to_diloco_and_back_keeps_the_ranks_identical_outside_it(tmp_path):
    res = fit(tmp_path, strategy(diloco_threshold=1e9))
    assert _steps(res[0]) == [("trial", TRIAL, None), ("enter", ENTER, "diloco10"), ("leave", LEAVE, "diloco10"),
                              ("verdict", VERDICT, "incumbent")]
    assert res[0]["sync"] == res[1]["sync"]  # every decision the same on both ranks
    runs = [s["diloco"] for s in res[0]["steps"]]
    # a step that switches ends in the family it switched to
    assert runs == [False] * ENTER + [True] * (LEAVE - ENTER) + [False] * (len(runs) - LEAVE)
    for r in res:  # DiLoCo's steps reach no hook; the engine counts them all the same
        assert r["global_step"] == r["engine_step"] == len(runs) == 48
        assert r["hook_calls"] == len(runs) - (LEAVE - ENTER)
    a, b = res[0]["steps"], res[1]["steps"]
    for step in range(len(runs)):
        inside = ENTER < step < LEAVE  # DiLoCo's inner steps before the round closes
        same = torch.equal(a[step]["params"], b[step]["params"])
        assert same != inside, f"step {step}: ranks {'identical' if same else 'differ'}"
        same = all(torch.equal(x, y) for x, y in zip(a[step]["moments"], b[step]["moments"]))
        assert same != inside, f"step {step}: momentum {'identical' if same else 'differs'}"
    # leaving: every rank's momentum is the mean of the ranks' right after the last inner step, sent in
    # bfloat16 (float64 of their bfloat16 roundings, within the rounding of the one partial sum)
    assert LEAVE_WIRE_DTYPE == torch.bfloat16
    pre = [a[LEAVE]["pre_moments"], b[LEAVE]["pre_moments"]]
    assert not all(torch.equal(x, y) for x, y in zip(*pre))
    for k, got in enumerate(a[LEAVE]["moments"]):
        x, y = (p[k].to(torch.bfloat16).double() for p in pre)
        assert ((got.double() - (x + y) / 2).abs() <= 2.0 ** -8 * (x.abs() + y.abs()) / 2).all()


def test_resume_from_a_checkpoint_written_while_diloco_runs_is_exact(tmp_path):
    """16 steps an epoch: the checkpoint after epoch 0 (step 16) falls inside DiLoCo's window (13-19),
    with the trial's first window's figures, θ_outer, each rank's θ_local and momentum in it."""
    ckpt_cb = L.pytorch.callbacks.ModelCheckpoint(dirpath=str(tmp_path / "ckpt"), save_top_k=-1, every_n_epochs=1)
    full = fit(tmp_path / "a", strategy(diloco_threshold=1e9), callbacks=[ckpt_cb], enable_checkpointing=True)
    ckpt_file = sorted((tmp_path / "ckpt").glob("epoch=0*.ckpt"))[0]
    state = torch.load(ckpt_file, weights_only=False)["lightning_gc"]
    assert state["diloco/shared"]["active"] and state["diloco/shared"]["choice"] == "diloco10"
    resumed = fit(tmp_path / "b", strategy(diloco_threshold=1e9), ckpt_path=str(ckpt_file))
    for r in range(2):
        assert _steps(resumed[r]) == _steps(full[r])  # the figures are timed: the events and their steps
        for k, v in full[r]["params"].items():
            assert torch.equal(v, resumed[r]["params"][k]), f"rank {r} {k} differs after resume"
        for k, v in full[r]["optimizer"]["state"].items():
            assert torch.equal(v["momentum_buffer"], resumed[r]["optimizer"]["state"][k]["momentum_buffer"])


def test_diloco_first_enters_at_the_trial_start_and_stays_where_not_separable(tmp_path):
    """``diloco_lead=1`` on the pinned slow link: the trial starts in DiLoCo (entered at the end of step
    2), leaves it when its first round reaches a multiple of H (9), runs the per-step window (10-19),
    enters again (19) and, the threshold out of reach, keeps DiLoCo, which runs on in rounds of 10
    (outer steps at 29 and 39: 30 and 40 steps done, as a run that started in DiLoCo would take them).
    Parameters are identical across ranks exactly where a round has closed or per-step DDP runs; the
    momentum exactly where per-step DDP runs (it is averaged on leaving, not at an outer step)."""
    # severe_drift 0: DiLoCo runs on after the verdict, and on a loaded machine the times of its outer
    # exchanges (loopback, milliseconds) can differ twice over, which would read as a moved link
    res = fit(tmp_path, strategy(diloco_lead=1.0, diloco_threshold=1e9, severe_drift=0))
    assert _steps(res[0]) == [("trial", D_ENTER, None), ("enter", D_ENTER, "diloco10"), ("leave", D_LEAVE, "diloco10"),
                              ("enter", D_BACK, "diloco10"), ("verdict", D_VERDICT, "challenger")]
    assert res[0]["sync"] == res[1]["sync"]
    runs = [s["diloco"] for s in res[0]["steps"]]
    assert runs == [False] * D_ENTER + [True] * (D_LEAVE - D_ENTER) + [False] * (D_BACK - D_LEAVE) + [True] * (48 - D_BACK)
    a, b = res[0]["steps"], res[1]["steps"]
    for step in range(48):
        inner = runs[step] and step not in (D_ENTER, D_BACK) and (step + 1) % 10 != 0
        same = torch.equal(a[step]["params"], b[step]["params"])
        assert same != inner, f"step {step}: ranks {'identical' if same else 'differ'}"
        same = all(torch.equal(x, y) for x, y in zip(a[step]["moments"], b[step]["moments"]))
        per_step = step <= D_ENTER or D_LEAVE <= step <= D_BACK  # the entering steps included, the leaving one averaged
        assert same == per_step, f"step {step}: momentum {'identical' if same else 'differs'}"


def test_entered_off_the_multiple_of_h_the_outer_steps_fall_on_it(tmp_path):
    """DiLoCo first with windows of 2 rounds: entered at the end of step 2 (3 steps done), the first
    outer step comes after 7 inner steps (10 done, the end of step 9), the next after 10 more (the end
    of step 19), where the window ends and DiLoCo is left. The ranks' parameters are identical after
    exactly those DiLoCo steps: the schedule itself is moved, not only where the trial cuts it."""
    res = fit(tmp_path, strategy(diloco_lead=1.0, diloco_rounds=2, diloco_threshold=1e9, severe_drift=0))
    assert _steps(res[0])[:3] == [("trial", 2, None), ("enter", 2, "diloco10"), ("leave", 19, "diloco10")]
    assert res[0]["sync"]["events"][1]["first_round"] == 7
    a, b = res[0]["steps"], res[1]["steps"]
    closed = [step for step in range(3, 20) if torch.equal(a[step]["params"], b[step]["params"])]
    assert closed == [9, 19]


def test_a_nan_step_under_diloco_ends_the_trial_and_per_step_resumes_finite_and_identical(tmp_path):
    """Rank 1's loss is NaN at step 15, inside DiLoCo's window (13-19): its gradient, momentum and
    parameters go NaN. The trial ends for the incumbent at the round's end (19), where the round is
    discarded (every rank back on θ_outer), rank 1's momentum takes rank 0's, and leaving averages
    finite states: per-step DDP then runs on finite, bit-identical ranks to the end."""
    from lit_models import TinyClassifier

    res = fit(tmp_path, strategy(diloco_threshold=1e9), model=TinyClassifier(momentum=0.9, nan_at_step=15, nan_rank=1))
    events = res[0]["sync"]["events"]
    assert _steps(res[0])[:3] == [("trial", TRIAL, None), ("enter", ENTER, "diloco10"), ("leave", LEAVE, "diloco10")]
    assert events[3]["event"] == "verdict" and events[3]["winner"] == "incumbent" and "non-finite" in events[3]["why"]
    a, b = res[0]["steps"], res[1]["steps"]
    assert not torch.isfinite(b[15]["params"]).all()  # the scenario is not vacuous
    for step in range(LEAVE, len(a)):
        assert torch.isfinite(a[step]["params"]).all(), step
        assert torch.equal(a[step]["params"], b[step]["params"]), step
        assert all(torch.equal(x, y) for x, y in zip(a[step]["moments"], b[step]["moments"])), step
