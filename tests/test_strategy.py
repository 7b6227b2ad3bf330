"""GCStrategy inside real Lightning training on 2 spawned CPU/gloo processes."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import lightning as L
import pytest
import torch
from dist_harness import run_distributed
from lit_models import ReportCallback, TinyClassifier, make_loader

from lightning_gc import GCStrategy
from lightning_gc.compressors import build_compressor
from lightning_gc.engine import EngineConfig, GCEngine
from lightning_gc.engine.session import StepSession

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[1]


def _fit(tmp: Path, strategy: GCStrategy, model=None, ckpt_path=None, logger=False, callbacks=(), **trainer_kw):
    out = tmp / "report"
    out.mkdir(parents=True, exist_ok=True)
    trainer = L.Trainer(
        strategy=strategy, accelerator="cpu", devices=2, logger=logger, enable_progress_bar=False,
        enable_model_summary=False, default_root_dir=str(tmp), callbacks=[ReportCallback(str(out)), *callbacks],
        **{"max_epochs": 2, "enable_checkpointing": False, **trainer_kw},
    )
    trainer.fit(model or TinyClassifier(), make_loader(), ckpt_path=ckpt_path)
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(2)]


def test_hook_runs_on_cpu_and_counts_optimizer_steps_with_accumulation(tmp_path):
    reports = _fit(tmp_path, GCStrategy(compressor="topk", ratio=0.1, start_method="forkserver"), accumulate_grad_batches=2)
    for rep in reports:
        assert rep["comm_hook"] == "gc_comm_hook"  # Lightning's DDPStrategy would not register it on CPU
        assert rep["hook_calls"] > 0
        assert rep["engine_step"] == rep["global_step"] == 8  # 256 samples / 2 ranks / 16 per batch / 2 accum × 2 epochs
        assert rep["totals"]["compressed_steps"] == 7  # one dense warm-up step
    for k in reports[0]["params"]:
        assert torch.equal(reports[0]["params"][k], reports[1]["params"][k])


def test_resume_from_epoch_checkpoint_is_exact(tmp_path):
    """Uninterrupted 3 epochs == 1 epoch, checkpoint, resume for 2 more (qsgd + error feedback:
    both per-rank memory and private randomness must be restored)."""

    def strategy():
        return GCStrategy(compressor="qsgd", error_feedback=True, start_method="forkserver", warmup_steps=2)

    ckpt_cb = L.pytorch.callbacks.ModelCheckpoint(dirpath=str(tmp_path / "ckpt"), save_top_k=-1, every_n_epochs=1)
    full = _fit(tmp_path / "a", strategy(), max_epochs=3, enable_checkpointing=True, callbacks=[ckpt_cb])
    ckpts = sorted((tmp_path / "ckpt").glob("epoch=0*.ckpt"))
    assert ckpts, list((tmp_path / "ckpt").iterdir())
    saved = torch.load(ckpts[0], weights_only=False)["lightning_gc"]
    assert saved["world_size"] == 2 and len(saved["ranks"]) == 2
    assert not torch.equal(saved["ranks"][0]["memory"]["net.0.weight"], saved["ranks"][1]["memory"]["net.0.weight"])
    resumed = _fit(tmp_path / "b", strategy(), max_epochs=3, ckpt_path=str(ckpts[0]))
    for r in range(2):
        assert resumed[r]["engine_step"] == full[r]["engine_step"]
        for k, v in full[r]["params"].items():
            assert torch.equal(v, resumed[r]["params"][k]), f"rank {r} {k} differs after resume"
        for k, v in full[r]["memory"].items():
            assert torch.equal(v, resumed[r]["memory"][k])


def test_nonfinite_step_skipped_on_all_ranks_and_monitor_writes_tensorboard(tmp_path):
    logger = L.pytorch.loggers.TensorBoardLogger(str(tmp_path), name="tb")
    model = TinyClassifier(nan_at_step=5, nan_rank=1)
    reports = _fit(tmp_path, GCStrategy(compressor="efsignsgd", start_method="forkserver"), model=model, logger=logger,
                   log_every_n_steps=1, max_epochs=1)
    for rep in reports:
        assert rep["skipped"] == 1 and rep["totals"]["nonfinite_steps"] == 1
        # the end-of-fit summary: one NaN injected (step 5, rank 1) -> one skipped step on every rank
        s = rep["summary"]
        assert (s["skipped_steps"], s["nonfinite_steps"]) == (1, 1)
        assert s["steps"] == rep["global_step"] == 8 and s["compressed_steps"] == 7  # 1 warm-up step
        assert all(rep["finite_after_each_step"])
        assert all(torch.isfinite(v).all() for v in rep["params"].values())
    for k in reports[0]["params"]:
        assert torch.equal(reports[0]["params"][k], reports[1]["params"][k])
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = list((tmp_path / "tb").rglob("events.out.tfevents.*"))
    assert events
    acc = EventAccumulator(str(events[0].parent))
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    for tag in ("gc/ratio", "gc/bytes_sent", "gc/bytes_dense", "gc/compress_ms", "gc/comm_ms", "gc/error_norm",
                "gc/gain", "gc/gain_ewma", "gc/nonfinite"):
        assert tag in tags, f"{tag} missing from {sorted(tags)}"
    assert [e.value for e in acc.Scalars("gc/nonfinite")].count(1.0) == 1
    sent = [e.value for e in acc.Scalars("gc/bytes_sent")]
    dense = [e.value for e in acc.Scalars("gc/bytes_dense")]
    assert sent[-1] < dense[-1] / 2  # 1-bit signs on the big weight; small tensors go exact


SCRIPT = textwrap.dedent(
    """
    import atexit, sys, lightning as L, torch.distributed as dist
    sys.path.insert(0, {tests!r})
    import lightning_gc
    from lit_models import TinyClassifier, make_loader
    rank = [None]
    # registered before fit, so it runs after every exit handler the fit registers (atexit is LIFO):
    # it records whether the default process group was still alive when the interpreter finalised
    atexit.register(lambda: open(f"exit_rank{{rank[0]}}.txt", "w").write(str(dist.is_initialized())))
    devices = int(sys.argv[1])
    trainer = L.Trainer(strategy=sys.argv[2], accelerator="cpu", devices=devices, max_steps=4, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(TinyClassifier(), make_loader())
    s = trainer.strategy
    rank[0] = trainer.global_rank
    # one file per rank: two processes printing to one stdout can interleave their lines
    with open(f"result_rank{{trainer.global_rank}}.txt", "w") as fh:
        fh.write(" ".join(map(str, ["RESULT", type(s).__name__, s.compressor_name, s.engine.world_size,
                                    s.engine.step, trainer.global_rank])))
    """
)


def _run_script(tmp_path, devices: int, alias: str) -> tuple[subprocess.CompletedProcess, list[str]]:
    script = tmp_path / "train.py"
    script.write_text(SCRIPT.format(tests=str(REPO / "tests")))
    env = {**os.environ, "PYTHONWARNINGS": "ignore::DeprecationWarning"}
    proc = subprocess.run([sys.executable, str(script), str(devices), alias], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=240)
    results = sorted(p.read_text() for p in tmp_path.glob("result_rank*.txt"))
    return proc, results


def test_string_alias_trains_with_two_processes(tmp_path):
    proc, results = _run_script(tmp_path, 2, "gc_lwtopk")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert results == ["RESULT GCStrategy lwtopk 2 4 0", "RESULT GCStrategy lwtopk 2 4 1"], proc.stdout[-2000:]
    # the gloo default group is destroyed by an exit handler before the interpreter finalises, on
    # both ranks (a group left to finalisation can abort the process after a good run: engine/exit.py)
    assert [(tmp_path / f"exit_rank{r}.txt").read_text() for r in range(2)] == ["False", "False"]


def test_world_size_one_trains_without_communication_and_says_so_once(tmp_path):
    proc, results = _run_script(tmp_path, 1, "gc_topk")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert results == ["RESULT GCStrategy topk 1 4 0"]
    assert (proc.stdout + proc.stderr).count("world size is 1") == 1


# ---------------------------------------------------------------- construction-time errors
@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"ratio": 0.0}, r"ratio=0.0 is invalid .* must lie in \(0, 1\]"),
        ({"ratio": 1.01}, r"ratio=1.01 is invalid"),
        ({"compressor": "top_k"}, r"unknown compressor 'top_k'. Valid compressors: dense, fp16"),
        ({"compressor": "topk", "collective": "allreduce"}, r"cannot travel by collective='allreduce'.*randomk.*'allgather'"),
        ({"compressor": "randomk", "collective": "allgather"}, r"cannot travel by collective='allgather'.*\['allreduce'"),
        ({"collective": "carrier_pigeon"}, r"unknown collective 'carrier_pigeon'"),
        ({"plan": "per_layer"}, r"plan='per_layer' is not a plan kind"),
        ({"warmup_steps": -1}, r"warmup_steps=-1 is invalid"),
        ({"compressor": "qsgd", "ratio": 0.1}, r"'qsgd' does not take a ratio"),
        ({"compressor_args": {"rounds": 3}}, r"\['rounds'\] are not options of compressor 'topk'"),
        ({"nonfinite": "ignore"}, r"nonfinite='ignore' is invalid"),
        ({"ddp_comm_hook": print}, r"installs its own DDP communication hook"),
    ],
)
def test_bad_arguments_are_refused_at_construction(kwargs, match):
    with pytest.raises(ValueError, match=match):
        GCStrategy(**kwargs)


def test_resume_with_other_world_size_resets_memory_with_warning():
    """Engine-level: a 2-rank checkpoint applied to a 1-process engine keeps the step, resets memory."""
    model = torch.nn.Linear(64, 32)
    strategy = GCStrategy(compressor="topk", ratio=0.1)
    strategy._engine = GCEngine(build_compressor("topk", ratio=0.1), EngineConfig(), list(model.named_parameters()))
    strategy._session = StepSession(strategy._engine)
    state = strategy.engine.state_dict()
    state.update(step=7, memory={"weight": torch.ones(64 * 32)})
    with pytest.warns(UserWarning, match="written with world size 2, this run has 1.*reset to zero"):
        strategy._apply_state({"world_size": 2, "ranks": [state, state]})
    assert strategy.engine.step == 7 and strategy.engine.memory == {}
    # same world size: memory restored by parameter name
    strategy._apply_state({"world_size": 1, "ranks": [state]})
    assert torch.equal(strategy.engine.memory[0], torch.ones(64 * 32))


def _cast_ranks(rank: int, world_size: int, tmp: str) -> dict:
    """The same 6 steps on 2 ranks with torch's fp16 hook, GCStrategy(compressor="fp16") and the same with
    error feedback, in this process group (the ranks exist already: the strategies start none)."""
    from lightning_gc.bench.methods import TorchHookDDPStrategy

    os.environ.update(LOCAL_RANK=str(rank), RANK=str(rank), NODE_RANK="0", WORLD_SIZE=str(world_size))
    strategies = {"torch": lambda: TorchHookDDPStrategy("fp16"),
                  "gc": lambda: GCStrategy(compressor="fp16", warmup_steps=0),
                  "gc_ef": lambda: GCStrategy(compressor="fp16", warmup_steps=0, error_feedback=True)}
    out = {}
    for which, strategy in strategies.items():
        L.seed_everything(0, verbose=False)
        model = TinyClassifier()
        trainer = L.Trainer(strategy=strategy(), accelerator="cpu", devices=2, max_steps=6, logger=False,
                            enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                            default_root_dir=tmp)
        trainer.fit(model, make_loader())
        engine = getattr(trainer.strategy, "engine", None)
        info = {} if engine is None else dict(dense_mode=engine.dense_mode,
                                              compressed=engine.totals()["compressed_steps"],
                                              bytes=engine.totals()["bytes_sent"])
        out[which] = {"params": [p.detach().clone() for p in model.parameters()], "info": info}
    return out


def test_a_plain_16_bit_cast_goes_on_ddps_buckets_as_torchs_hook(tmp_path):
    """GCStrategy(compressor="fp16") without error feedback sends DDP's buckets as torch's
    fp16_compress_hook does (GCStrategy._casts_on_buckets; the grouped path cost 1.39-1.44x the hook's
    step on mlp at 1 Gbit/s): after 6 steps on 2 ranks its parameters equal those of DDP with torch's
    hook bit for bit. With error feedback the compressor keeps the plan's groups (a rounding residual
    per group) and its steps are compressed ones."""
    out = run_distributed(_cast_ranks, 2, str(tmp_path), timeout=300)[0]
    assert all(torch.equal(a, b) for a, b in zip(out["torch"]["params"], out["gc"]["params"]))
    # by hand: TinyClassifier has 16·96 + 96 + 96·4 + 4 = 2020 parameters; a ring allreduce of 2-byte
    # elements at 2 ranks sends 2·(2 − 1)/2 · 2 · 2020 bytes per rank and step, and nothing else goes out
    assert out["gc"]["info"] == {"dense_mode": "fp16", "compressed": 0, "bytes": 6 * 2 * 2020}
    assert (out["gc_ef"]["info"]["dense_mode"], out["gc_ef"]["info"]["compressed"]) == (None, 6)
    # the residual is fed back, so the path differs from the hook's (it is not the buckets' path)
    assert not all(torch.equal(a, b) for a, b in zip(out["torch"]["params"], out["gc_ef"]["params"]))


class _WhereAmI(L.Callback):
    """Each rank writes what the launching test set in its environment and its working directory."""

    def on_train_end(self, trainer, pl_module):
        with open(f"rank{trainer.global_rank}.txt", "w") as fh:  # relative: in the worker's working directory
            fh.write(os.environ.get("LIGHTNING_GC_TEST_MARK", "missing"))


def test_forkserver_ranks_start_with_the_launchers_environment_and_their_own_module(tmp_path, monkeypatch):
    """start_method="forkserver": the workers fork from a server started before this test, yet they see the
    environment and working directory of the launching process at launch, and each trains its own copy of
    the module (shared tensors would make both ranks step one set of parameters: with plain SGD the result
    would differ from DDP's, the oracle here)."""
    monkeypatch.setenv("LIGHTNING_GC_TEST_MARK", "set-by-the-test")
    monkeypatch.chdir(tmp_path)
    L.seed_everything(0, verbose=False)
    reports = _fit(tmp_path, GCStrategy(compressor="dense", start_method="forkserver"), callbacks=[_WhereAmI()])
    assert [(tmp_path / f"rank{r}.txt").read_text() for r in range(2)] == ["set-by-the-test"] * 2
    L.seed_everything(0, verbose=False)
    ddp = _fit(tmp_path / "ddp", L.pytorch.strategies.DDPStrategy(start_method="spawn"))
    for r in range(2):
        for k, v in ddp[r]["params"].items():
            torch.testing.assert_close(reports[r]["params"][k], v, rtol=0, atol=1e-6)
