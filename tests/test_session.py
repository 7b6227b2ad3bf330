"""The step session: one owner of the step lifecycle (engine + ordered participants).

Single-process unit tests check the session's own contract in seconds (calling order, the skip
decision, one plan owner, checkpoint placement, snapshots); a 2-rank Lightning run checks the
composition that the session was built to fix: a rollback exploration with OSP must leave no
trace (before the session, the rollback's steps skipped OSP and the ranks drifted apart).
"""

from __future__ import annotations

import os

import lightning as L
import pytest
import torch
from dist_harness import run_distributed

from lightning_gc import AdaptiveRatio, GCStrategy
from lightning_gc.compressors import build_compressor
from lightning_gc.engine import EngineConfig, GCEngine
from lightning_gc.engine.session import StepParticipant, StepSession


def _engine(**cfg) -> tuple[GCEngine, torch.nn.Module]:
    torch.manual_seed(0)
    model = torch.nn.Linear(64, 32)
    engine = GCEngine(build_compressor("topk", ratio=0.1), EngineConfig(**cfg), list(model.named_parameters()))
    return engine, model


class _Recorder(StepParticipant):
    """Records every call the session makes, in order, into a shared log."""

    def __init__(self, name: str, log: list, bad: bool = False, owns: bool = False, scope: str = "rank") -> None:
        self.name = name  # type: ignore[misc]
        self.owns_plan = owns  # type: ignore[misc]
        self.state_scope = scope  # type: ignore[misc]
        self.log, self.bad, self.loaded, self.restored, self.plan_control = log, bad, None, None, None

    def bind_plan(self, control):
        self.plan_control = control

    def wrap_closure(self, closure):
        def wrapped():
            self.log.append((self.name, "closure"))
            return closure()
        return wrapped

    def before_optimizer_step(self, loss):
        self.log.append((self.name, "before"))
        return self.bad

    def prepare_step(self, optimizer):
        self.log.append((self.name, "prepare"))

    def skip_step(self):
        self.log.append((self.name, "skip"))

    def after_optimizer_step(self):
        self.log.append((self.name, "after"))

    def on_ratio_change(self, ratio):
        self.log.append((self.name, f"ratio={ratio}"))

    def drain(self, timeout=None):
        self.log.append((self.name, "drain"))
        return True

    def state_dict(self):
        return {"who": self.name}

    def load_state_dict(self, state):
        self.loaded = state
        self.log.append((self.name, "load"))

    def snapshot(self):
        return {"snap": self.name}

    def restore(self, snapshot):
        self.restored = snapshot
        self.log.append((self.name, "restore"))


def _step(session: StepSession, model: torch.nn.Module, optimizer: torch.optim.Optimizer, log: list):
    def closure():
        log.append(("loop", "closure"))
        optimizer.zero_grad()
        model(torch.ones(2, 64)).sum().backward()
        return torch.tensor(1.0)

    def run(c):
        c()
        log.append(("loop", "optimizer.step"))
        optimizer.step()

    session.optimizer_step(optimizer, closure, run)


def test_calling_order_of_a_taken_step():
    engine, model = _engine()
    log: list = []
    a, b = _Recorder("a", log), _Recorder("b", log)
    session = StepSession(engine, [a, b])
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    before = model.weight.detach().clone()
    _step(session, model, opt, log)
    # b wraps a's wrapper: the last participant's wrapper runs first
    assert log == [("b", "closure"), ("a", "closure"), ("loop", "closure"), ("a", "before"), ("b", "before"),
                   ("a", "prepare"), ("b", "prepare"), ("loop", "optimizer.step"), ("a", "after"), ("b", "after")]
    assert not torch.equal(model.weight, before) and session.skipped_steps == 0


@pytest.mark.parametrize("skip_nonfinite", [True, False])
def test_a_participant_reporting_nonfinite_skips_the_step_on_request(skip_nonfinite):
    engine, model = _engine()
    log: list = []
    a, b = _Recorder("a", log), _Recorder("b", log, bad=True)
    session = StepSession(engine, [a, b], skip_nonfinite=skip_nonfinite)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    before = model.weight.detach().clone()
    engine.step = 4  # the hook (not registered here) would have counted the step: it is step 3
    if skip_nonfinite:
        with pytest.warns(UserWarning, match="non-finite gradient at step 3; the optimizer step was skipped"):
            _step(session, model, opt, log)
    else:
        _step(session, model, opt, log)
    calls = [c for c in log if c[0] != "loop"]
    if skip_nonfinite:
        assert ("a", "skip") in calls and ("b", "skip") in calls and ("a", "prepare") not in calls
        assert torch.equal(model.weight, before) and model.weight.grad is None  # SGD skipped a grad-less parameter
        assert session.skipped_steps == 1
    else:
        assert ("a", "prepare") in calls and ("a", "skip") not in calls
        assert not torch.equal(model.weight, before) and session.skipped_steps == 0
    assert calls[-2:] == [("a", "after"), ("b", "after")]


def test_exactly_one_plan_owner_gets_the_plan_control():
    engine, _ = _engine()
    log: list = []
    owner, other = _Recorder("owner", log, owns=True), _Recorder("other", log)
    session = StepSession(engine, [other, owner])
    assert session.plan_owner is owner and owner.plan_control is engine and other.plan_control is None
    with pytest.raises(ValueError, match=r"two participants want to own the merge plan: \['x', 'y'\]"):
        StepSession(engine, [_Recorder("x", log, owns=True), _Recorder("y", log, owns=True)])
    with pytest.raises(ValueError, match="distinct names"):
        StepSession(engine, [_Recorder("x", log), _Recorder("x", log)])


def test_set_ratio_reaches_the_engine_and_every_participant():
    engine, _ = _engine()
    log: list = []
    session = StepSession(engine, [_Recorder("a", log), _Recorder("b", log)])
    session.set_ratio(0.25)
    assert float(engine.compressor.ratio) == 0.25
    assert log == [("a", "ratio=0.25"), ("b", "ratio=0.25")]
    with pytest.raises(ValueError):  # validated by the compressor before anything changes
        session.set_ratio(1.5)
    assert float(engine.compressor.ratio) == 0.25 and len(log) == 2


def test_checkpoint_state_places_rank_and_replicated_parts_and_loads_participants_first():
    engine, _ = _engine()
    log: list = []
    r, rep = _Recorder("perrank", log), _Recorder("shared", log, scope="replicated")
    session = StepSession(engine, [r, rep])
    engine.step = 5
    state = session.state_dict()
    assert state["world_size"] == 1 and len(state["ranks"]) == 1
    assert state["ranks"][0]["perrank"] == {"who": "perrank"} and "shared" not in state["ranks"][0]
    assert state["shared"] == {"who": "shared"} and "perrank" not in state
    assert state["ranks"][0]["step"] == 5
    log.clear()
    engine.step = 0
    session.load_state_dict(state)
    assert (r.loaded, rep.loaded) == ({"who": "perrank"}, {"who": "shared"}) and engine.step == 5
    assert log == [("perrank", "drain"), ("shared", "drain"), ("shared", "load"), ("perrank", "load")][2:]


def test_world_size_change_keeps_the_step_and_resets_memory():
    engine, _ = _engine()
    session = StepSession(engine)
    state = engine.state_dict()
    state.update(step=7, memory={"weight": torch.ones(64 * 32)})
    with pytest.warns(UserWarning, match="written with world size 2, this run has 1.*reset to zero"):
        assert session.load_state_dict({"world_size": 2, "ranks": [state, state]}) == []
    assert engine.step == 7 and engine.memory == {}
    assert session.load_state_dict({"world_size": 1, "ranks": [state]}) == []  # the bias is sent exactly: no memory
    assert torch.equal(engine.error_memory_by_name()["weight"].reshape(-1), torch.ones(64 * 32))


def test_snapshot_restores_engine_participants_and_skip_counter():
    engine, _ = _engine()
    log: list = []
    a = _Recorder("a", log)
    session = StepSession(engine, [a])
    engine.step, session.skipped_steps = 3, 1
    snap = session.snapshot()
    engine.step, session.skipped_steps = 9, 4
    engine.load_error_memory({"weight": torch.full((32, 64), 2.0)})
    session.restore(snap)
    assert engine.step == 3 and session.skipped_steps == 1 and a.restored == {"snap": "a"}
    assert engine.error_memory_by_name() == {}  # no memory at snapshot time
    session.restore(snap)  # a snapshot stays valid
    assert engine.step == 3


# ---------------------------------------------------------------------- rollback + OSP (2 ranks)
def _rollback_osp_ranks(rank, world_size, tmp):
    from lit_models import TinyClassifier, make_loader

    os.environ.update(LOCAL_RANK=str(rank), RANK=str(rank), NODE_RANK="0", WORLD_SIZE=str(world_size))

    class Model(TinyClassifier):
        def __init__(self):
            super().__init__(num_features=16, hidden=128, lr=0.1)
            self.net = torch.nn.Sequential(torch.nn.Linear(16, 128), torch.nn.ReLU(), torch.nn.Linear(128, 64),
                                           torch.nn.ReLU(), torch.nn.Linear(64, 4))

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-4)

    class Replay(L.Callback):
        def __init__(self, schedule):
            self.schedule = schedule

        def on_fit_start(self, trainer, pl_module):
            trainer.strategy.engine.raise_warmup_steps(3)

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            eng = trainer.strategy.engine
            if eng.step in self.schedule:
                trainer.strategy.session.set_ratio(self.schedule[eng.step])

    def fit(callbacks):
        L.seed_everything(3, verbose=False)
        model = Model()
        trainer = L.Trainer(
            strategy=GCStrategy(compressor="topk", ratio=0.05, sync="osp", osp_deferred_fraction=0.4,
                                osp_deferred_compressor="topk", osp_deferred_ratio=0.1),
            accelerator="cpu", devices=2, max_steps=9, logger=False, enable_progress_bar=False,
            enable_model_summary=False, enable_checkpointing=False, default_root_dir=str(tmp), callbacks=callbacks,
            num_sanity_val_steps=0)
        trainer.fit(model, make_loader(n=512, seed=rank))  # rank-dependent batches: the deferred layers differ
        return model, trainer

    cb = AdaptiveRatio(mode="rollback", warmup_steps=3, steps_per_candidate=2, min_interval=3, settle_steps=1,
                       gain_threshold=1e-9, pop_size=12, n_gen=8)
    model, trainer = fit([cb])
    out = {"rollback": {n: p.detach().clone() for n, p in model.named_parameters()},
           "history": [(h["step"], h["c"]) for h in cb.history], "osp_step": trainer.strategy.osp.step}
    model, _ = fit([Replay({h["step"]: h["c"] for h in cb.history})])
    out["replay"] = {n: p.detach().clone() for n, p in model.named_parameters()}
    return out


@pytest.mark.slow
def test_rollback_exploration_with_osp_leaves_no_trace(tmp_path):
    """AdaptiveRatio(mode='rollback') with sync='osp' (compressed deferred stage with error feedback):
    ranks stay bit-identical, and the run equals one that never explored but set the same ratios at
    the same steps (the rollback steps go through OSP, and the snapshot holds OSP's state, its
    deferred exchange in flight included)."""
    a, b = run_distributed(_rollback_osp_ranks, 2, str(tmp_path), timeout=600)
    assert len(a["history"]) >= 2 and a["history"] == b["history"]  # explored at least twice
    assert a["osp_step"] == 9
    for n in a["rollback"]:
        assert torch.equal(a["rollback"][n], b["rollback"][n]), n  # ranks identical
        assert torch.equal(a["rollback"][n], a["replay"][n]), n  # no trace of the exploration
