"""The adaptive compression-ratio controller (lightning_gc.adaptive, AdaptiveRatio).

Oracles:
* the decision against an exhaustive grid + an independent ASF / pseudo-weights implementation
  (tests/adaptive_oracle.py, no lightning_gc code) on the same objective data;
* shadow gains against torch.topk energies computed here;
* rollback: a run that explores continues bit for bit like a run that never explored and applies
  the same ratio at the same step; the state right after the exploration equals the state before;
* resume: a run resumed from a checkpoint holds the same c, history and engine ratio.
"""

from __future__ import annotations

import dataclasses
import math
import os
import types

import lightning as L
import numpy as np
import pytest
import torch
from adaptive_oracle import grid_decision
from dist_harness import run_distributed

from lightning_gc import AdaptiveRatio, GCStrategy
from lightning_gc.adaptive import (
    AdaptiveConfig,
    CandidateResult,
    ObjectiveData,
    ShadowScorer,
    candidate_ratios,
    decide,
)
from lightning_gc.compressors import GroupContext, build_compressor


# ---------------------------------------------------------------------------------------------- config
def test_default_candidates_are_the_papers():
    assert [round(c, 3) for c in AdaptiveConfig().candidates] == [0.1, 0.033, 0.011, 0.004, 0.001]
    # c_min is always measured: a last step shorter than sqrt(factor) replaces the nearest candidate,
    # a longer one adds c_min
    assert candidate_ratios(0.01, 0.1, 2.0) == pytest.approx((0.1, 0.05, 0.025, 0.01))
    assert candidate_ratios(0.005, 0.1, 3.0) == pytest.approx((0.1, 0.1 / 3, 0.1 / 9, 0.005))
    assert AdaptiveConfig(weights=(3, 3, 4)).weights == pytest.approx((0.3, 0.3, 0.4))


@pytest.mark.parametrize("kwargs, match", [
    ({"c_min": 0.1, "c_max": 0.1}, r"c_min=0.1 must be smaller than c_max=0.1"),
    ({"c_min": 0.2, "c_max": 0.1}, r"c_min=0.2 must be smaller"),
    ({"c_max": 1.5}, r"c_max=1.5 is invalid.*\(0, 1\]"),
    ({"c_min": 0.0}, r"c_min=0.0 is invalid.*\(0, 1\]"),
    ({"c_min": -0.01}, r"c_min=-0.01 is invalid"),
    ({"weights": (0, 0, 0)}, r"weights=\(0, 0, 0\) must be non-negative and sum to a positive number"),
    ({"weights": (0.5, 0.5, -1.0)}, r"must be non-negative and sum to a positive"),
    ({"weights": (0.5, 0.5)}, r"must be three numbers"),
    ({"mode": "explore"}, r"mode='explore' is not an exploration mode"),
    ({"rule": "knee"}, r"rule='knee' is unknown"),
    ({"normalise": "range"}, r"normalise='range' is unknown"),
    ({"factor": 1.0}, r"factor=1.0 must be > 1"),
    ({"warmup_steps": 0}, r"warmup_steps=0 is invalid"),
])
def test_bad_settings_refused_at_construction(kwargs, match):
    with pytest.raises(ValueError, match=match):
        AdaptiveRatio(**kwargs)


def _fake_trainer(strategy):
    return types.SimpleNamespace(strategy=strategy)


def test_compressor_without_ratio_and_foreign_strategy_refused_at_setup():
    module = types.SimpleNamespace(automatic_optimization=True)
    with pytest.raises(ValueError, match=r"cannot tune compressor 'qsgd': it has no ratio.*Use a compressor that takes one"):
        AdaptiveRatio().setup(_fake_trainer(GCStrategy(compressor="qsgd")), module, "fit")
    with pytest.raises(ValueError, match=r"needs a lightning_gc GCStrategy, got DDPStrategy"):
        from lightning.pytorch.strategies import DDPStrategy

        AdaptiveRatio().setup(_fake_trainer(DDPStrategy()), module, "fit")
    AdaptiveRatio().setup(_fake_trainer(GCStrategy(compressor="mstopk")), module, "fit")  # takes a ratio: accepted


# ---------------------------------------------------------------------------------------------- decision
def _random_case(seed: int):
    rng = np.random.default_rng(seed)
    rule = ("asf", "pseudo_weights")[seed % 2]
    cfg = AdaptiveConfig(weights=tuple(rng.uniform(0.1, 1.0, 3)), rule=rule)
    colls = ("allgather", "art_ring", "art_tree") if seed % 3 else ("allgather",)
    alpha, beta = 10 ** rng.uniform(-5, -2), 8 / 10 ** rng.uniform(7.5, 10)
    numels, n = (int(10 ** rng.uniform(5, 7)), 30000), int(rng.choice([2, 4, 8, 16]))
    # gain grows with c, compression time falls with c (the paper's Fig. 3 and §3-E shapes), noisy
    gains = np.sort(rng.uniform(0.02, 1.0, 5))
    tcomp = np.sort(rng.uniform(0.001, 0.02, 5))[::-1]
    cands = [CandidateResult(c=c, t_comp_s=float(t), gain=float(g)) for c, t, g in zip(sorted(cfg.candidates), tcomp, gains)]
    data = ObjectiveData(cands, colls, alpha, beta, numels, n, 4, float(rng.uniform(0.5, 3.0)))
    return cfg, data


@pytest.mark.parametrize("seed", range(4))
def test_nsga2_pick_matches_exhaustive_grid_with_independent_rule(seed):
    cfg, data = _random_case(seed)
    d = decide(data, cfg)
    raw = [(x.c, x.t_comp_s, x.gain) for x in data.candidates]
    c_grid, coll_grid, F_grid = grid_decision(raw, data.collectives, data.alpha_s, data.beta_s_per_byte, data.numels,
                                              data.world_size, cfg.c_min, cfg.c_max, cfg.weights, cfg.rule,
                                              data.calibration)
    # NSGA-II's front is a sample of pop_size points over log(c_max/c_min): its resolution
    resolution = math.log(cfg.c_max / cfg.c_min) / cfg.pop_size
    assert abs(math.log(d.c / c_grid)) <= 1.5 * resolution, (d.c, c_grid)
    assert d.collective == coll_grid
    # every reported front point is on (or within sampling of) the grid's front: none is dominated
    # by a grid-front point by more than 1 % in every objective
    for f in d.front:
        Fi = np.array(f[2:])
        assert not (F_grid * 1.01 < Fi).all(axis=1).any()
    # determinism: the same inputs give the same decision (what makes ranks agree)
    assert decide(data, cfg) == d


@pytest.mark.parametrize("seed", range(10, 16))
def test_step_normalised_asf_matches_exhaustive_grid(seed):
    """normalise="step": the two time objectives are divided by the measured step, not by the front's
    range; the independent grid + rule must pick the same c. The step is drawn around the front's
    time spread, where the choice is interior and depends on the scale."""
    _, data = _random_case(seed)
    rng = np.random.default_rng(seed)
    coll = data.collectives[0]
    spread = data.t_sync_s(0.1, coll) - data.t_sync_s(0.001, coll)
    data.step_s = float(spread * 10 ** rng.uniform(-0.3, 0.7))
    cfg = AdaptiveConfig(weights=tuple(rng.uniform(0.1, 1.0, 3)), rule="asf", normalise="step")
    d = decide(data, cfg)
    raw = [(x.c, x.t_comp_s, x.gain) for x in data.candidates]
    c_grid, coll_grid, _ = grid_decision(raw, data.collectives, data.alpha_s, data.beta_s_per_byte, data.numels,
                                         data.world_size, cfg.c_min, cfg.c_max, cfg.weights, "asf",
                                         data.calibration, step_s=data.step_s)
    resolution = math.log(cfg.c_max / cfg.c_min) / cfg.pop_size
    assert abs(math.log(d.c / c_grid)) <= 1.5 * resolution, (d.c, c_grid)
    assert d.collective == coll_grid


def test_step_normalisation_weighs_time_against_the_step():
    """Analytic expectation: when every candidate's time is a negligible part of the step, the gain
    decides (c_max, the largest gain); when the times dwarf the step, time decides (c_min).
    Front normalisation ignores the step and picks the same interior point in both cases."""
    cfg = AdaptiveConfig()
    cands = [CandidateResult(c=c, t_comp_s=0.002, gain=min(1.0, 0.05 + 3 * c)) for c in cfg.candidates]
    base = ObjectiveData(cands, ("allgather",), 1e-4, 8e-8, (2_000_000,), 4)  # t_sync(0.1) ≈ 0.1 s
    resolution = math.log(cfg.c_max / cfg.c_min) / cfg.pop_size
    long_step = decide(dataclasses.replace(base, step_s=1000.0), cfg).c
    short_step = decide(dataclasses.replace(base, step_s=1e-4), cfg).c
    assert abs(math.log(long_step / cfg.c_max)) <= 1.5 * resolution
    assert abs(math.log(short_step / cfg.c_min)) <= 1.5 * resolution
    front = AdaptiveConfig(normalise="front")
    a, b = decide(dataclasses.replace(base, step_s=1000.0), front).c, decide(dataclasses.replace(base, step_s=1e-4), front).c
    assert a == b and cfg.c_min * 1.5 < a < cfg.c_max / 1.5


def test_weights_move_the_choice_the_documented_way():
    cfg, data = _random_case(3)
    gain_heavy = decide(data, AdaptiveConfig(weights=(0.05, 0.05, 0.9))).c
    time_heavy = decide(data, AdaptiveConfig(weights=(0.45, 0.45, 0.1))).c
    assert gain_heavy > time_heavy  # more weight on the gain keeps more elements


def test_collective_follows_the_network():
    cfg = AdaptiveConfig()
    cands = [CandidateResult(c=c, t_comp_s=0.001, gain=min(1.0, 0.2 + 4 * c)) for c in cfg.candidates]
    colls = ("allgather", "art_ring", "art_tree")
    # 4 ranks, 25 M elements: low latency → ART-Ring; a 50 ms latency makes allgather's fewer messages win
    fast = decide(ObjectiveData(cands, colls, 1e-6, 8e-9, (25_000_000,), 4), cfg)
    slow = decide(ObjectiveData(cands, colls, 5e-2, 8e-9, (25_000_000,), 4), cfg)
    assert fast.collective == "art_ring" and slow.collective == "allgather"


# ---------------------------------------------------------------------------------------------- shadow
def test_shadow_scorer_gain_is_topk_energy_ratio_and_leaves_input_alone():
    torch.manual_seed(0)
    comp = build_compressor("topk", ratio=0.05)
    scorer = ShadowScorer(comp, (0.1, 0.01))
    ps = [torch.randn(5000) * (1 + torch.arange(5000) % 7) for _ in range(2)]
    for step, p in enumerate(ps):
        before = p.clone()
        scorer(0, p, GroupContext(step=step, rank=0, world_size=2, segments=(5000,)))
        assert torch.equal(p, before)
    assert comp.ratio == 0.05  # the live compressor keeps its ratio
    res = scorer.results()
    p2 = sum(float(p.pow(2).sum()) for p in ps)
    for r, c in zip(res, (0.1, 0.01)):
        k = math.ceil(c * 5000)
        sent2 = sum(float(torch.topk(p.abs(), k).values.pow(2).sum()) for p in ps)
        assert r.gain == pytest.approx(sent2 / p2, rel=1e-5)
        assert r.t_comp_s > 0 and r.steps == 2
    assert res[0].gain > res[1].gain


# ---------------------------------------------------------------------------------------------- Lightning, 2 ranks
def _lightning_env(rank: int, world_size: int) -> None:
    os.environ.update(LOCAL_RANK=str(rank), RANK=str(rank), NODE_RANK="0", WORLD_SIZE=str(world_size))


def _trainer(tmp, callbacks, max_steps, logger=False, **kw):
    return L.Trainer(
        strategy=GCStrategy(compressor=kw.pop("compressor", "topk"), ratio=0.05), accelerator="cpu", devices=2,
        max_steps=max_steps, logger=logger, enable_progress_bar=False, enable_model_summary=False,
        enable_checkpointing=False, default_root_dir=str(tmp), callbacks=callbacks, log_every_n_steps=1,
        num_sanity_val_steps=0, **kw,
    )


def _state(pl_module, trainer):
    engine = trainer.strategy.engine
    engine.synchronize()
    return {
        "params": {n: p.detach().clone() for n, p in pl_module.named_parameters()},
        "opt": {k: {kk: (vv.clone() if torch.is_tensor(vv) else vv) for kk, vv in v.items()}
                for k, v in trainer.optimizers[0].state_dict()["state"].items()},
        "lr": [g["lr"] for g in trainer.optimizers[0].param_groups],
        "sched": trainer.lr_scheduler_configs[0].scheduler.state_dict() if trainer.lr_scheduler_configs else None,
        "memory": {k: v.clone() for k, v in engine.memory.items()},
        "engine_step": engine.step,
        "ratio": float(engine.compressor.ratio),
        "rng": torch.get_rng_state(),
    }


class _ProbingRollback(AdaptiveRatio):
    """AdaptiveRatio that records the training state right before and right after each exploration."""

    def __init__(self, **kw):
        super().__init__(**kw)
        self.around: list[tuple[dict, dict]] = []
        self.moved: list[bool] = []
        self.candidate_ratios: list[float] = []

    def _real_step(self, trainer, pl_module, engine, optimizer, batch, batch_idx):
        out = super()._real_step(trainer, pl_module, engine, optimizer, batch, batch_idx)
        ref = self.around_ref["params"]
        self.moved.append(any(not torch.equal(p, ref[n]) for n, p in pl_module.named_parameters()))
        self.candidate_ratios.append(float(engine.compressor.ratio))
        return out

    def _rollback(self, trainer, pl_module, engine):
        before = self.around_ref = _state(pl_module, trainer)
        out = super()._rollback(trainer, pl_module, engine)
        self.around.append((before, _state(pl_module, trainer)))
        return out


class _Replay(L.Callback):
    """A run that never explores: the same warm-up, then set_ratio(c) at the same step boundaries."""

    def __init__(self, warmup: int, schedule: dict[int, float]) -> None:
        self.warmup, self.schedule = warmup, schedule

    def on_fit_start(self, trainer, pl_module):
        eng = trainer.strategy.engine
        eng.config = dataclasses.replace(eng.config, warmup_steps=self.warmup)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        eng = trainer.strategy.engine
        if eng.step in self.schedule:
            eng.set_ratio(self.schedule[eng.step])


def _lightning_ranks(rank, world_size, tmp):
    from lit_models import TinyClassifier, make_loader

    _lightning_env(rank, world_size)
    out = {}

    class Model(TinyClassifier):
        def __init__(self):
            super().__init__(lr=0.1)
            self.drop = torch.nn.Dropout(0.2)  # forward draws from the global RNG: rollback must restore it

        def forward(self, x):
            return self.net(self.drop(x))

        def configure_optimizers(self):
            opt = torch.optim.SGD(self.parameters(), lr=self.hparams.lr, momentum=0.9, weight_decay=1e-4)
            return {"optimizer": opt, "lr_scheduler": {"scheduler": torch.optim.lr_scheduler.StepLR(opt, 2, 0.7),
                                                       "interval": "step"}}

    # --- 1. rollback exploration vs a run that never explored
    L.seed_everything(7, verbose=False)
    # explorations at the end of warm-up (3) and, forced by a tiny gain threshold, every 4 steps after:
    # the later ones start with non-zero error memory and momentum
    cb = _ProbingRollback(mode="rollback", warmup_steps=3, steps_per_candidate=2, min_interval=4, settle_steps=1,
                          gain_threshold=1e-9, pop_size=12, n_gen=8)
    model = Model()
    _trainer(tmp, [cb], 10).fit(model, make_loader(n=512))
    out["rollback_params"] = {n: p.detach().clone() for n, p in model.named_parameters()}
    out["rollback_history"] = [(h["step"], h["c"], h["collective"]) for h in cb.history]
    out["around"] = cb.around
    out["moved"], out["candidate_ratios"] = cb.moved, cb.candidate_ratios

    L.seed_everything(7, verbose=False)
    model = Model()
    schedule = {h["step"]: h["c"] for h in cb.history}
    _trainer(tmp, [_Replay(3, schedule)], 10).fit(model, make_loader(n=512))
    out["replay_params"] = {n: p.detach().clone() for n, p in model.named_parameters()}

    # --- 2. shadow mode with TensorBoard, a checkpoint, and a resume
    from lightning.pytorch.loggers import TensorBoardLogger

    L.seed_everything(3, verbose=False)
    cb = AdaptiveRatio(mode="shadow", warmup_steps=3, shadow_steps=2, min_interval=1000, pop_size=12, n_gen=8)
    logger = TensorBoardLogger(str(tmp), name="tb", version=0)
    trainer = _trainer(tmp, [cb], 8, logger=logger)
    trainer.fit(Model(), make_loader(n=512))
    ckpt = os.path.join(str(tmp), "adaptive.ckpt")
    trainer.save_checkpoint(ckpt)
    out["shadow_history"] = cb.history
    out["shadow_c"] = cb.c
    out["shadow_engine_ratio"] = float(trainer.strategy.engine.compressor.ratio)

    class Check(L.Callback):
        def on_train_start(self, trainer, pl_module):
            out["resumed_engine_ratio"] = float(trainer.strategy.engine.compressor.ratio)
            out["resumed_c"] = cb2.c
            out["resumed_history"] = list(cb2.history)

    cb2 = AdaptiveRatio(mode="shadow", warmup_steps=3, shadow_steps=2, min_interval=1000, pop_size=12, n_gen=8)
    trainer = _trainer(tmp, [cb2, Check()], 10)
    trainer.fit(Model(), make_loader(n=512), ckpt_path=ckpt)
    out["resumed_final_ratio"] = float(trainer.strategy.engine.compressor.ratio)
    out["resumed_final_history_len"] = len(cb2.history)
    return out


def test_lightning_rollback_leaves_no_trace_shadow_logs_and_resume_keeps_c(tmp_path):
    res = run_distributed(_lightning_ranks, 2, str(tmp_path), timeout=240)
    r0, r1 = res
    # --- rollback: decisions at the end of warm-up and at the forced re-explorations, identical on both ranks
    assert r0["rollback_history"] == r1["rollback_history"]
    assert [h[0] for h in r0["rollback_history"]] == [3, 7]
    assert all(0.001 <= h[1] <= 0.1 and h[2] == "allgather" for h in r0["rollback_history"])
    for r in res:
        assert len(r["around"]) == 2
        for (before, after), step in zip(r["around"], (3, 7)):
            for key in ("params", "memory"):
                assert before[key].keys() == after[key].keys()
                for k in before[key]:
                    assert torch.equal(before[key][k], after[key][k]), (key, k)
            assert before["opt"].keys() == after["opt"].keys() and before["opt"]
            for k in before["opt"]:
                assert torch.equal(before["opt"][k]["momentum_buffer"], after["opt"][k]["momentum_buffer"])
            assert before["lr"] == after["lr"] and before["sched"] == after["sched"]
            assert before["engine_step"] == after["engine_step"] == step
            assert torch.equal(before["rng"], after["rng"])
            assert before["ratio"] == after["ratio"]  # the decision is applied after the restore
        assert r["around"][1][0]["memory"]  # the second exploration had error memory to restore
        # ... and training then continued exactly as the run that never explored
        for n, p in r["rollback_params"].items():
            assert torch.equal(p, r["replay_params"][n]), n
        # the exploration really trained every candidate (else the checks above would be void)
        assert r["moved"] == [True] * 20
        assert r["candidate_ratios"] == pytest.approx([c for c in AdaptiveConfig().candidates for _ in range(2)] * 2)

    # --- shadow: first decision at warm-up (3) + shadow steps (2), identical on both ranks
    h0, h1 = r0["shadow_history"], r1["shadow_history"]
    assert [(h["step"], h["c"]) for h in h0] == [(h["step"], h["c"]) for h in h1]
    assert h0[0]["step"] == 5 and h0[0]["trigger"] == "warmup"
    gains = [x["gain"] for x in h0[0]["data"]["candidates"]]
    assert gains == sorted(gains, reverse=True) and 0 < gains[-1] < gains[0] <= 1  # c_max first
    assert h0[0]["data"] == h1[0]["data"]  # every number the decision used is agreed
    assert r0["shadow_engine_ratio"] == pytest.approx(r0["shadow_c"])
    # --- resume: same c in the engine and the callback, same history
    for r in res:
        assert r["resumed_c"] == r["shadow_c"] and r["resumed_engine_ratio"] == pytest.approx(r["shadow_c"])
        assert [h["step"] for h in r["resumed_history"]] == [h["step"] for h in r["shadow_history"]]
        assert r["resumed_final_ratio"] == pytest.approx(r["shadow_c"])  # min_interval: no new decision
        assert r["resumed_final_history_len"] == len(r["shadow_history"])

    # --- TensorBoard: c over time, gc/ratio every logged step, the decision and the front figure
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(tmp_path / "tb" / "version_0"), size_guidance={"images": 10, "scalars": 0})
    acc.Reload()
    tags = acc.Tags()
    assert "adaptive/pareto_front" in tags["images"]
    ratios = {e.step: e.value for e in acc.Scalars("gc/ratio")}
    cs = {e.step: e.value for e in acc.Scalars("adaptive/c")}
    assert ratios.keys() == cs.keys() and len(ratios) == 8
    c = r0["shadow_c"]
    assert [e.value for e in acc.Scalars("adaptive/decision_c")] == pytest.approx([c])
    assert ratios[max(ratios)] == pytest.approx(c) and cs[max(cs)] == pytest.approx(c)  # in force after the decision
    assert ratios[min(ratios)] == 1.0  # dense warm-up


# ---------------------------------------------------------------------------------------------- reach
def test_bench_method_option_adds_the_controller_and_recipe_builds_it(tmp_path, monkeypatch):
    from lightning.pytorch.cli import LightningCLI

    from lightning_gc.bench.methods import MethodError, build_callbacks, build_strategy, parse_methods

    spec, = parse_methods("topk:adaptive=rollback:adaptive_min_interval=30:adaptive_weights=x", default_ratio=0.01)
    with pytest.raises(MethodError, match=r"weights='x' must be three numbers"):
        build_callbacks(spec)
    spec, = parse_methods("topk:adaptive=rollback:adaptive_min_interval=30", default_ratio=0.01)
    cb, = build_callbacks(spec)
    assert cb.config.mode == "rollback" and cb.config.min_interval == 30
    strategy = build_strategy(spec)  # the controller's keys do not reach GCStrategy
    assert strategy.compressor_name == "topk" and strategy.config.compression.compressor_config().ratio == 0.01
    assert build_callbacks(parse_methods("topk", default_ratio=0.01)[0]) == []
    with pytest.raises(MethodError, match=r"adaptive='shadow' needs a lightning_gc compressor that takes a ratio"):
        build_callbacks(parse_methods("qsgd:adaptive=shadow", default_ratio=0.01)[0])
    with pytest.raises(MethodError, match=r"mode='explore' is not an exploration mode"):
        build_callbacks(parse_methods("topk:adaptive=explore", default_ratio=0.01)[0])

    monkeypatch.chdir(tmp_path)
    cli = LightningCLI(args=["--config", os.path.join(os.path.dirname(__file__), "..", "recipes", "adaptive.yaml")],
                       run=False)
    cb, = [c for c in cli.trainer.callbacks if isinstance(c, AdaptiveRatio)]
    assert cb.config.mode == "shadow" and cb.config.weights == pytest.approx((0.3, 0.3, 0.4))
    assert cli.trainer.strategy.compressor_name == "artopk_auto"
