"""Every cross-rank safety check of the engine and the network probe, triggered on each rank in turn.

On 3 gloo ranks, for ``odd`` = 0, 1, 2, one rank differs from the other two and every rank must
raise (nobody hangs, nobody proceeds), naming the ranks by what they would have done — the grouping
is checked as a value (``[[0, 2], [1]]`` when rank 1 differs), so a check that compares only with
rank 0, or only reports the first rank, fails:

* the engine's **opening check** (the step's descriptor, with ``check_every=1``: before every
  step): a ratio changed behind the engine's back, a step counter that differs, a network model
  that differs (for a model-chosen collective), a plan installed without the agreement (the plan
  digest of each step);
* the **closing report's** copy of the same check (the default schedule, no opening check on that
  step): a ratio changed by too little to change k, a step counter moved to another compressed
  step — the exchanges complete, and every rank stops at the close before the step is applied; also
  with ``lowrank`` (fp32 and bfloat16 messages), whose report rides in the step's last message, the
  hash as 32 summed bits;
* the engine's **setup signature** (a rank-dependent compressor option);
* ``GCEngine.set_ratio``, ``GCEngine.replace_plan`` and ``GCEngine.set_group_method`` (values
  compared before anything changes);
* the probe's **argument fingerprint** (``probe_network``) and ``ensure_replicated``;
* a **payload of the wrong size** on one rank (a compressor bug): zeros travel in its place, so no
  rank waits in the allgather, and every rank stops at the step's close with the count of such ranks.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from dist_harness import run_distributed

WS = 3


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 8))


def _batch(rank: int, step: int):
    g = torch.Generator().manual_seed(97 * rank + step)
    return torch.randn(4, 16, generator=g) * (1.0, 0.4, 2.0)[(rank + step) % 3], torch.randn(4, 8, generator=g)


def _engine(model, compressor: str = "topk", **cfg):
    from lightning_gc.compressors import build_compressor
    from lightning_gc.engine import EngineConfig, GCEngine

    return GCEngine(build_compressor(compressor, ratio=0.1),
                    EngineConfig(**{"plan": "layer", "min_compress_numel": 0, "warmup_steps": 1, **cfg}),
                    list(model.named_parameters()))


def _opening(rank: int, odd: int, how: str) -> str:
    from torch.nn.parallel import DistributedDataParallel as DDP

    from lightning_gc.comm.cost_model import NetworkModel
    from lightning_gc.engine import gc_comm_hook

    model = _model()
    ddp = DDP(model, bucket_cap_mb=0.001)
    if how == "network":  # a model-chosen collective: the agreed network model is part of each step
        engine = _engine(model, "artopk_auto", network_alpha_s=1e-4, network_beta_s_per_byte=8e-8, check_every=1)
    else:
        engine = _engine(model, check_every=1)
    ddp.register_comm_hook(engine, gc_comm_hook)
    try:
        for step in range(4):
            if step == 2 and rank == odd:
                if how == "ratio":
                    engine.compressor.config = dataclasses.replace(engine.compressor.config, ratio=0.3)
                elif how == "step":
                    engine.step = 0
                elif how == "plan":  # installed without the agreement (verify=False): the step's digest
                    from lightning_gc.plans import build_plan

                    engine.replace_plan(build_plan(engine.names, [p.numel() for p in engine.params], kind="model",
                                                   min_compress_numel=0), verify=False)
                else:
                    engine.network.model = NetworkModel(2e-4, 8e-8)
            x, y = _batch(rank, step)
            ddp.zero_grad()
            torch.nn.functional.mse_loss(ddp(x), y).backward()
        return "no error"
    except RuntimeError as e:
        return str(e)
    finally:
        engine.close()


def _closing(rank: int, odd: int, how: str) -> str:
    """The default schedule (no opening check at step 2): a divergence that keeps every payload's size."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    from lightning_gc.compressors import build_compressor
    from lightning_gc.engine import EngineConfig, GCEngine, gc_comm_hook

    model = _model()
    ddp = DDP(model, bucket_cap_mb=0.001)
    if how.startswith("lowrank"):  # the report rides in the Q allreduce (the last group's last message)
        wire = "bfloat16" if "bf16" in how else "float32"
        engine = GCEngine(build_compressor("lowrank", args=dict(rank=2, wire_dtype=wire)),
                          EngineConfig(plan="layer", min_compress_numel=0, warmup_steps=1),
                          list(model.named_parameters()))
    else:
        engine = _engine(model)
    assert engine.config.check_every > 3  # so step 2 opens without the check on every rank
    ddp.register_comm_hook(engine, gc_comm_hook)

    def diverge(step: int) -> None:
        if step == 2 and rank == odd:
            if how == "ratio":  # 0.1 → 0.1005: k is the same for every tensor (52, 4, 26, 1)
                engine.compressor.config = dataclasses.replace(engine.compressor.config, ratio=0.1005)
            else:  # another compressed step: other shared random streams, the same sizes
                engine.step = 7

    try:
        return f"{_sgd_steps(rank, model, ddp, engine, diverge)} [opening checks: {engine.opening_checks}]"
    finally:
        engine.close()


def _sgd_steps(rank: int, model, ddp, engine, before_step=None) -> str:
    """Four SGD steps through ``ddp``; the error's text and whether the failing step changed the
    parameters (``[parameters changed: …]``), or ``"no error"``."""
    before = [p.detach().clone() for p in model.parameters()]
    try:
        for step in range(4):
            if before_step is not None:
                before_step(step)
            x, y = _batch(rank, step)
            ddp.zero_grad()
            torch.nn.functional.mse_loss(ddp(x), y).backward()
            engine.before_optimizer_step()
            with torch.no_grad():
                for p in model.parameters():
                    p.sub_(0.1 * p.grad)
            before = [p.detach().clone() for p in model.parameters()]
        return "no error"
    except RuntimeError as e:
        changed = any(not torch.equal(a, b) for a, b in zip(before, model.parameters()))
        return f"{e} [parameters changed: {changed}]"


def _setup(rank: int, odd: int) -> str:
    from lightning_gc.compressors import build_compressor
    from lightning_gc.engine import EngineConfig, GCEngine

    model = _model()
    try:
        GCEngine(build_compressor("topk", ratio=0.2 if rank == odd else 0.1), EngineConfig(),
                 list(model.named_parameters())).close()
    except RuntimeError as e:
        return str(e)
    return "no error"


def _set_ratio(rank: int, odd: int) -> tuple[str, float]:
    engine = _engine(_model())
    try:
        engine.set_ratio(0.25 if rank == odd else 0.5)
        return "no error", float(engine.compressor.ratio)
    except RuntimeError as e:
        return str(e), float(engine.compressor.ratio)
    finally:
        engine.close()


def _replace_plan(rank: int, odd: int) -> tuple[str, str]:
    from lightning_gc.plans import build_plan

    model = _model()
    engine = _engine(model)
    before = engine.plan.signature()
    plan = build_plan(engine.names, [p.numel() for p in engine.params], kind="model" if rank == odd else "layer",
                      min_compress_numel=0)
    try:
        engine.replace_plan(plan)
        return "no error", before
    except RuntimeError as e:
        return str(e), engine.plan.signature() == before and before
    finally:
        engine.close()


def _set_group_method(rank: int, odd: int) -> tuple[str, bool]:
    from lightning_gc.engine.slots import MethodSpec

    engine = _engine(_model())
    gid = next(g.gid for g in engine.plan.groups if not g.exact)
    try:
        engine.set_group_method(gid, MethodSpec("topk", ratio=0.2 if rank == odd else 0.3))
        return "no error", False
    except RuntimeError as e:
        return str(e), engine.slot_of(gid) is engine.default_slot
    finally:
        engine.close()


def _probe(rank: int, odd: int) -> tuple[str, str]:
    from lightning_gc.comm.cost_model import NetworkModel
    from lightning_gc.comm.probe import ProbeConfig, ensure_replicated, probe_network

    try:
        probe_network(config=ProbeConfig(sizes_bytes=(64, 1024), warmup=0, repeats=3 if rank == odd else 1))
        probe = "no error"
    except ValueError as e:
        probe = str(e)
    try:
        ensure_replicated(NetworkModel(1e-4, 8e-8 if rank != odd else 9e-8))
        repl = "no error"
    except ValueError as e:
        repl = str(e)
    return probe, repl


def _payload(rank: int, odd: int) -> str:
    """Top-k whose payload on rank ``odd`` at step 2 is one element short (values and indices)."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    from lightning_gc.compressors.base import Compressed
    from lightning_gc.engine import gc_comm_hook

    model = _model()
    ddp = DDP(model, bucket_cap_mb=0.001)
    engine = _engine(model)
    ddp.register_comm_hook(engine, gc_comm_hook)
    compress = engine.compressor.compress

    def short(x, ctx):
        c = compress(x, ctx)
        # the exchanged step from its context: engine.step is advanced by the main thread while the worker
        # compresses, so keyed on it the short payload could land on another step, or none, under load
        if ctx.step == 2 and rank == odd:
            return Compressed(tuple(t[:-1] for t in c.payload), c.meta)
        return c

    engine.compressor.compress = short
    try:
        return _sgd_steps(rank, model, ddp, engine)
    finally:
        engine.close()


def _all(rank: int, ws: int) -> dict:
    out = {}
    for odd in range(ws):
        for how in ("ratio", "step", "network", "plan"):
            out["opening", how, odd] = _opening(rank, odd, how)
        for how in ("ratio", "step", "lowrank_step", "lowrank_bf16_step"):
            out["closing", how, odd] = _closing(rank, odd, how)
        out["setup", odd] = _setup(rank, odd)
        out["set_ratio", odd] = _set_ratio(rank, odd)
        out["replace_plan", odd] = _replace_plan(rank, odd)
        out["set_group_method", odd] = _set_group_method(rank, odd)
        out["probe", odd] = _probe(rank, odd)
        out["payload", odd] = _payload(rank, odd)
    return out


@pytest.fixture(scope="module")
def runs():
    return run_distributed(_all, WS, timeout=280)


def _grouping(odd: int) -> str:
    """The ranks grouped by what they do, groups in order of their first rank."""
    same = [r for r in range(WS) if r != odd]
    return str([same, [odd]] if odd > 0 else [[odd], same])


@pytest.mark.parametrize("odd", range(WS))
@pytest.mark.parametrize("how", ["ratio", "step", "network", "plan"])
def test_opening_check_fails_fast_on_every_rank_whichever_rank_differs(runs, how, odd):
    for rank, res in enumerate(runs):
        msg = res["opening", how, odd]
        assert "about to issue different exchanges" in msg, (rank, msg)
        assert f"Ranks grouped by what they would do: {_grouping(odd)}" in msg, (rank, msg)
        assert "at step 2 " in msg or "at step 0 " in msg, msg


@pytest.mark.parametrize("odd", range(WS))
@pytest.mark.parametrize("how", ["ratio", "step", "lowrank_step", "lowrank_bf16_step"])
def test_closing_report_stops_every_rank_before_the_step_is_applied(runs, how, odd):
    for rank, res in enumerate(runs):
        msg = res["closing", how, odd]
        at = 7 if how.endswith("step") and rank == odd else 2  # each rank names the step it believes it ran
        assert f"at step {at} the ranks issued different exchanges (found by the step's closing report" in msg, (rank, msg)
        assert f"Ranks grouped by what they would do: {_grouping(odd)}" in msg, (rank, msg)
        assert "[parameters changed: False]" in msg, (rank, msg)
        # only the dense warm-up step 0 opened with the check: steps 1 and 2 did not
        assert "[opening checks: 1]" in msg, (rank, msg)


@pytest.mark.parametrize("odd", range(WS))
def test_setup_signature_names_the_odd_rank(runs, odd):
    for rank, res in enumerate(runs):
        msg = res["setup", odd]
        assert "ranks built different communication setups" in msg, (rank, msg)
        assert f"Ranks grouped by setup: {_grouping(odd)}" in msg, (rank, msg)


@pytest.mark.parametrize("odd", range(WS))
def test_set_ratio_refused_everywhere_and_nothing_changes(runs, odd):
    want = {r: (0.25 if r == odd else 0.5) for r in range(WS)}
    for rank, res in enumerate(runs):
        msg, ratio = res["set_ratio", odd]
        assert f"(rank → ratio: {want})" in msg, (rank, msg)
        assert ratio == 0.1  # the ratio in force is untouched on every rank


@pytest.mark.parametrize("odd", range(WS))
def test_replace_plan_refused_everywhere_and_the_plan_kept(runs, odd):
    for rank, res in enumerate(runs):
        msg, kept = res["replace_plan", odd]
        assert "ranks built different communication setups" in msg, (rank, msg)
        assert f"Ranks grouped by setup: {_grouping(odd)}" in msg, (rank, msg)
        assert kept, (rank, "the plan changed although the ranks disagreed")


@pytest.mark.parametrize("odd", range(WS))
def test_set_group_method_refused_everywhere_and_the_default_kept(runs, odd):
    for rank, res in enumerate(runs):
        msg, kept = res["set_group_method", odd]
        assert "ranks built different communication setups" in msg, (rank, msg)
        assert f"Ranks grouped by setup: {_grouping(odd)}" in msg, (rank, msg)
        assert kept, (rank, "the group's method changed although the ranks disagreed")


@pytest.mark.parametrize("odd", range(WS))
def test_probe_arguments_and_replicated_network_checked_whichever_rank_differs(runs, odd):
    for rank, res in enumerate(runs):
        probe, repl = res["probe", odd]
        assert "different arguments on different ranks" in probe, (rank, probe)
        assert "network model differs across ranks" in repl, (rank, repl)
        assert "beta in [8e-08, 9e-08]" in repl, (rank, repl)


@pytest.mark.parametrize("odd", range(WS))
def test_payload_of_the_wrong_size_stops_every_rank_without_a_hang(runs, odd):
    for rank, res in enumerate(runs):
        msg = res["payload", odd]
        assert f"at step 2 1 of {WS} ranks produced a compressed payload of another size" in msg, (rank, msg)
        here = "this rank's: payload of" if rank == odd else "not this rank's"
        assert here in msg, (rank, msg)
        assert "[parameters changed: False]" in msg, (rank, msg)  # the step was not applied


def _schedule(rank: int, ws: int) -> list[int]:
    """The steps that opened with the check, under check_every=3, a plan installed with verify=False
    before step 5 and a checkpoint load before step 10."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    from lightning_gc.engine import gc_comm_hook
    from lightning_gc.plans import build_plan

    model = _model()
    ddp = DDP(model, bucket_cap_mb=0.001)
    engine = _engine(model, check_every=3)
    ddp.register_comm_hook(engine, gc_comm_hook)
    checked = []
    try:
        for step in range(12):
            if step == 5:
                engine.replace_plan(build_plan(engine.names, [p.numel() for p in engine.params], kind="layer",
                                               min_compress_numel=0), verify=False)
            if step == 10:
                engine.load_state_dict(engine.state_dict())
            n = engine.opening_checks
            x, y = _batch(rank, step)
            ddp.zero_grad()
            torch.nn.functional.mse_loss(ddp(x), y).backward()
            engine.before_optimizer_step()
            if engine.opening_checks > n:
                checked.append(step)
        return checked
    finally:
        engine.close()


def test_opening_check_schedule_is_the_documented_one_on_every_rank():
    # by hand: 0 (a dense warm-up step always checks), 3, 6, 9 (multiples of check_every), 5 (after a plan
    # installed without a comparison), 10 (after a checkpoint load)
    for checked in run_distributed(_schedule, 2, timeout=120):
        assert checked == [0, 3, 5, 6, 9, 10], checked
