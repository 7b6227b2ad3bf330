"""The one assembly and the thin strategy, without processes: the session's lifecycle dispatch,
``GCStrategy(config=...)`` against the flat keywords, and the startup header's text.

Oracles: call logs written by recorder participants (order and arguments by hand), the tree built
by ``GCConfig.from_flat`` directly, and header strings written out by hand.
"""

from __future__ import annotations

import contextlib
from types import SimpleNamespace

import pytest
import torch

from lightning_gc import GCStrategy
from lightning_gc.assembly import startup_header
from lightning_gc.callbacks.session_hooks import SessionHooks, put_first
from lightning_gc.config import GCConfig
from lightning_gc.engine.session import StepParticipant, StepSession


class _Recorder(StepParticipant):
    def __init__(self, name: str, log: list, swaps: bool = False, clip_scale: float | None = None) -> None:
        self.name, self.log, self.swaps, self.clip_scale = name, log, swaps, clip_scale

    def on_train_start(self):
        self.log.append((self.name, "train_start"))

    def on_train_batch_start(self, batch_idx):
        self.log.append((self.name, "batch", batch_idx))

    def on_validation_start(self):
        self.log.append((self.name, "val_start"))

    def on_validation_end(self):
        self.log.append((self.name, "val_end"))

    def on_checkpoint_saved(self):
        self.log.append((self.name, "saved"))

    def drain(self, timeout=None):
        self.log.append((self.name, "drain"))
        return True

    def on_train_end(self):
        self.log.append((self.name, "train_end"))

    def finish(self):
        self.log.append((self.name, "finish"))

    def on_optimizer_state_loaded(self, optimizers):
        self.log.append((self.name, "loaded", len(optimizers)))

    @contextlib.contextmanager
    def evaluation_view(self):
        self.log.append((self.name, "view_in"))
        yield self.swaps
        self.log.append((self.name, "view_out"))

    def clip_gradients(self, optimizer, max_value, algorithm, plain):
        self.log.append((self.name, "clip", max_value, algorithm))
        if self.clip_scale is None:
            return plain()
        for group in optimizer.param_groups:
            for p in group["params"]:
                p.grad.mul_(self.clip_scale)
        return plain()


def _session(log, **kw):
    return StepSession(object(), [_Recorder("a", log, **kw.get("a", {})), _Recorder("b", log, **kw.get("b", {}))])


def test_the_session_dispatches_every_lifecycle_hook_in_the_participants_order():
    log: list = []
    s = _session(log)
    s.on_train_start()
    s.on_train_batch_start(3)
    s.on_validation_start()
    s.on_validation_end()
    s.on_checkpoint_saved()
    s.on_optimizer_state_loaded([None, None])
    s.on_train_end()
    s.finish()
    assert log == [("a", "train_start"), ("b", "train_start"), ("a", "batch", 3), ("b", "batch", 3),
                   ("a", "val_start"), ("b", "val_start"), ("a", "val_end"), ("b", "val_end"),
                   ("a", "saved"), ("b", "saved"), ("a", "loaded", 2), ("b", "loaded", 2),
                   # work in flight finished before any end of training
                   ("a", "drain"), ("b", "drain"), ("a", "train_end"), ("b", "train_end"),
                   ("a", "drain"), ("b", "drain"), ("a", "finish"), ("b", "finish")]


@pytest.mark.parametrize(("swaps", "want"), [((False, False), False), ((False, True), True)])
def test_the_evaluation_view_nests_in_order_and_says_whether_a_participant_swapped(swaps, want):
    log: list = []
    s = _session(log, a={"swaps": swaps[0]}, b={"swaps": swaps[1]})
    with s.evaluation_view() as swapped:
        log.append("inside")
    assert swapped is want
    assert log == [("a", "view_in"), ("b", "view_in"), "inside", ("b", "view_out"), ("a", "view_out")]


def test_clipping_runs_through_every_participant_then_the_plain_clipping():
    log: list = []
    s = _session(log, a={"clip_scale": 0.5})
    p = torch.nn.Parameter(torch.ones(3))
    p.grad = torch.full((3,), 4.0)
    opt = torch.optim.SGD([p], lr=1.0)
    s.clip_gradients(opt, 1.5, "norm", lambda: log.append(("plain", p.grad.tolist())))
    assert log == [("a", "clip", 1.5, "norm"), ("b", "clip", 1.5, "norm"), ("plain", [2.0, 2.0, 2.0])]
    StepSession(object(), [StepParticipant()]).clip_gradients(opt, 1.0, "value", lambda: log.append("default"))
    assert log[-1] == "default"  # a participant without clipping of its own passes through


def test_the_session_callback_is_kept_first_even_where_the_user_listed_it_later():
    user, ours = object(), SessionHooks()
    callbacks = [user, ours]
    put_first(callbacks)
    assert callbacks == [ours, user]
    callbacks = [user]
    put_first(callbacks)
    assert isinstance(callbacks[0], SessionHooks) and callbacks[1] is user


FLAT = dict(compressor="topk", ratio=0.05, plan="layer", warmup_steps=3, sync="osp", osp_round_steps=20,
            osp_deferred_compressor="qsgd")


def test_config_tree_and_flat_keywords_give_the_same_configuration():
    flat = GCStrategy(**FLAT)
    tree = GCStrategy(config=GCConfig.from_flat(**FLAT))
    assert tree.config == flat.config == GCConfig.from_flat(**FLAT)
    assert tree.compressor_name == flat.compressor_name == "topk"
    assert GCStrategy(config=GCConfig.from_flat(compressor="auto")).compressor_name == "auto"


def test_config_tree_with_a_flat_keyword_is_refused_naming_it():
    with pytest.raises(ValueError, match=r"got config= and ratio=0\.2: the configuration comes from one place"):
        GCStrategy(config=GCConfig.from_flat(compressor="topk"), ratio=0.2)
    with pytest.raises(TypeError, match=r"expected a lightning_gc.config.GCConfig"):
        GCStrategy(config={"compressor": "topk"})


def _engine(collective="allgather", groups=2, ef=True, dense_mode=None):
    return SimpleNamespace(exchange=SimpleNamespace(name=collective), plan=SimpleNamespace(groups=[0] * groups),
                           error_feedback=ef, dense_mode=dense_mode)


def test_the_header_names_the_compressor_collective_and_plan():
    cfg = GCConfig.from_flat(compressor="topk", ratio=0.01)
    assert startup_header(cfg, _engine()) == ("lightning_gc: compressor=topk collective=allgather plan=model groups=2 "
                                              "warmup_steps=1 error_feedback=True")
    cast = startup_header(GCConfig.from_flat(compressor="fp16"), _engine("allreduce", 1, False, "fp16"))
    assert cast.endswith("error_feedback=False; a plain fp16 cast: sent on DDP's buckets as torch's 16-bit hook "
                         "(dense mode fp16, docs/compressors.md)")


def test_the_header_of_auto_says_auto_and_its_candidates_not_the_engines_slot():
    cfg = GCConfig.from_flat(compressor="auto", auto={"candidates": ("ddp", "fp16", "topk")})
    header = startup_header(cfg, _engine("auto_sparse"))
    assert header.startswith("lightning_gc: compressor=auto candidates=ddp,fp16,topk plan=model warmup_steps=")
    assert "auto_sparse" not in header and "error_feedback" not in header and "artopk" not in header


def test_the_header_shows_osp_and_its_options():
    schedule = startup_header(GCConfig.from_flat(compressor="topk", sync="osp", osp_round_steps=20), _engine())
    assert schedule.endswith("error_feedback=True sync=osp deferred=S(Gu) schedule round_steps=20 "
                             "deferred_compressor=dense")
    pinned = startup_header(GCConfig.from_flat(compressor="topk", sync="osp", osp_deferred_fraction=0.3,
                                               osp_deferred_compressor="topk", osp_deferred_ratio=0.1), _engine())
    assert pinned.endswith("sync=osp deferred_fraction=0.3 deferred_compressor=topk deferred_ratio=0.1")


def test_the_header_shows_diloco_and_its_options():
    cfg = GCConfig.from_flat(compressor="dense", sync="diloco", diloco_inner_steps=8, diloco_fragments=2,
                             diloco_overlap_steps=1, diloco_mixing=0.5)
    assert startup_header(cfg, _engine("allreduce")) == (
        "lightning_gc: sync=diloco inner_steps=8 fragments=2 overlap_steps=1 mixing=0.5 "
        "outer=SGD({'lr': 0.7, 'momentum': 0.9, 'nesterov': True}) delta=dense (dense fp32 allreduce)")
    topk = GCConfig.from_flat(compressor="topk", ratio=0.1, sync="diloco")
    diloco = SimpleNamespace(exchange=SimpleNamespace(name="allgather"), error_feedback=True, nodes=None)
    assert startup_header(topk, _engine(), diloco).endswith("delta=topk collective=allgather error_feedback=True")


def _diloco(**cfg):
    from lightning_gc.sync.diloco import DiLoCoConfig, DiLoCoSync

    params = [torch.zeros(3), torch.zeros(2)]
    engine = SimpleNamespace(params=params, names=["w", "b"], world_size=1, rank=0, device=torch.device("cpu"),
                             process_group=None, config=SimpleNamespace(seed=0),
                             add_deferred_traffic=lambda sent, payload, bytes_inter_node=0: None)
    return DiLoCoSync(engine, DiLoCoConfig(**cfg)), params


def test_diloco_closes_its_round_once_at_the_end_of_training_with_mixing():
    """With mixing > 0 every fragment counts as differing from θ_outer, so only the closing step's
    own record stops a second close (teardown after on_train_end) from stepping again: θ_outer after
    one outer SGD step on Δ = −(the inner moves), by hand."""
    sync, params = _diloco(inner_steps=4, mixing=0.5, outer_args={"lr": 1.0, "momentum": 0.9})
    session = StepSession(object(), [sync])
    for move in (1.0, 2.0):  # two inner steps: θ_local = 3 everywhere
        for p in params:
            p.add_(move)
        sync.after_optimizer_step()
    with session.evaluation_view() as swapped:
        assert swapped and all(torch.equal(p, torch.zeros_like(p)) for p in params)  # θ_outer inside
    assert all(torch.equal(p, torch.full_like(p, 3.0)) for p in params)  # θ_local again after
    session.on_train_end()
    closed = [p.clone() for p in params]
    assert all(torch.equal(p, torch.full_like(p, 3.0)) for p in closed)  # 0 − 1.0·(0 − 3), mixing 0 at the close
    session.finish()  # teardown: nothing left to close
    assert sync.outer_steps == 1 and all(torch.equal(a, b) for a, b in zip(params, closed))


def test_a_diloco_checkpoint_is_refused_by_the_other_kind_of_diloco_naming_the_fix():
    """sync="diloco" runs from the first step; auto's DiLoCo (with a FamilySwitch) is entered and left.
    Each refuses the other's checkpoint: a dormant one has nothing to resume from, a static one no
    configuration name to enter."""
    from lightning_gc.sync.diloco import DiLoCoConfig, DiLoCoSync

    static, _ = _diloco(inner_steps=2)
    switch = SimpleNamespace(resolve=lambda name: (DiLoCoConfig(inner_steps=2), None, "auto", False),
                             set_gradient_sync=lambda on: flags.append(on))
    flags: list[bool] = []
    switching = DiLoCoSync(static.engine, DiLoCoConfig(), switch=switch)
    assert not switching.active and switching.shared_state_dict() == {"active": False}
    with pytest.raises(ValueError, match="ran per-step; resume it with compressor='auto'"):
        static.load_shared_state_dict(switching.shared_state_dict())
    with pytest.raises(ValueError, match="written by sync='diloco'; resume it with sync='diloco'"):
        switching.load_shared_state_dict(static.shared_state_dict())
    switching.enter("diloco2")  # a switching checkpoint resumes in the family it saved in
    saved = switching.shared_state_dict()
    fresh = DiLoCoSync(static.engine, DiLoCoConfig(), switch=switch)
    fresh.load_shared_state_dict(saved)
    assert fresh.active and fresh.choice == "diloco2" and fresh.config.inner_steps == 2 and flags == [False, False]


@pytest.mark.parametrize("first", [2, 7])
def test_a_first_round_moves_every_outer_step_and_survives_a_checkpoint(first):
    """Entered with ``first_round``, DiLoCo (H = 4) takes its outer steps after ``first``, ``first`` + 4,
    ... inner steps; a checkpoint written mid-round resumes on the same schedule (by hand: the inner
    steps after which ``outer_steps`` grows)."""
    from lightning_gc.sync.diloco import DiLoCoConfig, DiLoCoSync

    static, _ = _diloco(inner_steps=4)
    switch = SimpleNamespace(resolve=lambda name: (DiLoCoConfig(inner_steps=4), None, "auto", False),
                             set_gradient_sync=lambda on: None)
    sync = DiLoCoSync(static.engine, DiLoCoConfig(), switch=switch)
    with pytest.raises(ValueError, match=r"first_round=8 must be an integer in \[1, 2H\) = \[1, 8\)"):
        sync.enter("diloco4", 8)
    sync.enter("diloco4", first)

    def outer_after(s: DiLoCoSync, steps: int) -> list[int]:
        out = []
        for _ in range(steps):
            before = s.outer_steps
            s.after_optimizer_step()
            if s.outer_steps > before:
                out.append(s.inner_step)
        return out

    assert outer_after(sync, first + 1) == [first]
    fresh = DiLoCoSync(static.engine, DiLoCoConfig(), switch=switch)
    fresh.load_shared_state_dict(sync.shared_state_dict())
    assert outer_after(fresh, 8) == [first + 4, first + 8]
