"""What a Lightning user sees during and after a 2-process run: unused parameters, the end-of-fit
summary, and warm-up visible in TensorBoard."""

from __future__ import annotations

import os

import lightning as L
import pytest
import torch
from dist_harness import run_distributed
from lit_models import TinyClassifier, make_loader

from lightning_gc import GCMonitor, GCStrategy
from lightning_gc.compressors import build_compressor

pytestmark = pytest.mark.slow

# ---------------------------------------------------------------- 3. unused parameters
class WithUnused(TinyClassifier):
    def __init__(self):
        super().__init__()
        self.unused = torch.nn.Linear(40, 40)  # never called in forward: no gradient


def _unused_rank(rank: int, world_size: int, strategy: str, tmp: str) -> str:
    """4 steps of a model with an unused layer through the alias ``strategy``, in this process group (the
    ranks exist already): what the run ended with, the error's message or the engine's counts."""
    os.environ.update(LOCAL_RANK=str(rank), RANK=str(rank), NODE_RANK="0", WORLD_SIZE=str(world_size))
    trainer = L.Trainer(strategy=strategy, accelerator="cpu", devices=2, max_steps=4, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        default_root_dir=tmp)
    try:
        trainer.fit(WithUnused(), make_loader())
    except RuntimeError as e:
        return f"error: {e}"
    s = trainer.strategy
    return f"{type(s).__name__} {s.compressor_name} {s.engine.step} {s.engine.totals()['compressed_steps']}"


def test_unused_parameters_error_says_how_to_fix_it_with_gcstrategy(tmp_path):
    errors = run_distributed(_unused_rank, 2, "gc_topk", str(tmp_path), timeout=240)
    for err in errors:  # every rank stops with the advice
        assert err.startswith("error: ") and "GCStrategy(compressor='topk', find_unused_parameters=True)" in err, err
        assert "gc_topk_find_unused_parameters_true" in err
        assert "find_unused_parameters: true" in err  # the recipe (YAML) form
        # Lightning's own advice would replace GCStrategy by plain DDP without compression
        assert "strategy='ddp_find_unused_parameters_true'`" not in err
        assert "DDPStrategy(find_unused_parameters=True)`" not in err
    # ... and the advice works: the alias trains with compression
    results = run_distributed(_unused_rank, 2, "gc_topk_find_unused_parameters_true", str(tmp_path), timeout=240)
    assert results == ["GCStrategy topk 4 3", "GCStrategy topk 4 3"]  # 4 steps, 1 dense warm-up


# ---------------------------------------------------------------- 7 + 9. summary and visible warm-up
class SummaryProbe(L.Callback):
    """Writes each rank's ``strategy.summary()`` and the trainer's own step count at the end of fit."""

    def __init__(self, out_dir: str) -> None:
        self.out_dir = out_dir

    def on_fit_end(self, trainer, pl_module):
        s = trainer.strategy.summary()
        torch.save({"summary": s.as_dict(), "global_step": trainer.global_step,
                    "numel": sum(p.numel() for p in pl_module.parameters())},
                   os.path.join(self.out_dir, f"summary{trainer.global_rank}.pt"))


WARMUP = 3
EPOCHS = 2


@pytest.fixture(scope="module")
def fp16_run(tmp_path_factory):
    """fp16 on every tensor (min_compress_numel=0): bytes are computable by hand. With error feedback,
    so that its steps are compressed ones through the plan's groups (a plain cast goes on DDP's
    buckets as a dense mode instead: GCStrategy._casts_on_buckets); the bytes are the same."""
    tmp = tmp_path_factory.mktemp("fp16run")
    logger = L.pytorch.loggers.TensorBoardLogger(str(tmp), name="tb")
    strategy = GCStrategy(compressor="fp16", min_compress_numel=0, check_finite=False, warmup_steps=WARMUP,
                          error_feedback=True, start_method="spawn")  # spawn: the ranks print to this test's stdout
    trainer = L.Trainer(strategy=strategy, accelerator="cpu", devices=2, logger=logger, max_epochs=EPOCHS,
                        log_every_n_steps=50, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, callbacks=[GCMonitor(), SummaryProbe(str(tmp))])
    # the spawned ranks inherit file descriptor 2: collect what they print in one file
    with open(tmp / "stderr.txt", "w") as fh:
        saved = os.dup(2)
        os.dup2(fh.fileno(), 2)
        try:
            trainer.fit(TinyClassifier(), make_loader())
        finally:
            os.dup2(saved, 2)
            os.close(saved)
    return tmp, [torch.load(tmp / f"summary{r}.pt", weights_only=False) for r in range(2)]


def test_end_of_fit_summary_matches_an_independent_count(fp16_run):
    tmp, reports = fp16_run
    n = 256 // 2 // 16 * EPOCHS  # samples / ranks / batch size × epochs = optimizer steps
    numel = 16 * 96 + 96 + 96 * 4 + 4  # TinyClassifier: Linear(16, 96) + Linear(96, 4)
    dense_step = 2 * (2 - 1) / 2 * 4 * numel  # ring allreduce of fp32 gradients, 2 ranks
    fp16_step = 2 * (2 - 1) / 2 * 2 * numel  # the same in fp16
    # the engine's agreement: the opening check all-gathers 8 bytes per rank on every dense warm-up step
    # and, on compressed steps, at step 0 and multiples of check_every (50) only: none of steps 3-15; the
    # closing report sum-allreduces 13 float64 values on every compressed step (docs/concepts.md)
    opening, closing = (2 - 1) * 8, 2 * (2 - 1) / 2 * 13 * 8
    dense_step_sent, fp16_step_sent = dense_step + opening, fp16_step + closing
    for r, rep in enumerate(reports):
        s = rep["summary"]
        assert rep["numel"] == numel and rep["global_step"] == n
        assert (s["compressor"], s["collective"], s["world_size"], s["rank"]) == ("fp16", "allreduce", 2, r)
        assert (s["steps"], s["compressed_steps"], s["dense_steps"]) == (n, n - WARMUP, WARMUP)
        assert s["bytes_dense"] == n * dense_step
        assert s["bytes_sent"] == WARMUP * dense_step_sent + (n - WARMUP) * fp16_step_sent
        assert s["bytes_ratio"] == pytest.approx((WARMUP * dense_step_sent + (n - WARMUP) * fp16_step_sent)
                                                 / (n * dense_step))
        assert s["nonfinite_steps"] == 0 and s["skipped_steps"] == 0
        assert s["compress_time_s"] > 0 and s["comm_time_s"] > 0


def test_summary_text_states_the_counts(fp16_run):
    from lightning_gc.summary import GCSummary

    _, reports = fp16_run
    text = GCSummary(**reports[0]["summary"]).format()
    assert "optimizer steps: 16 (13 compressed, 3 dense)" in text
    # (3·(8080 + 8) + 13·(4040 + 104)) / (16·8080) = 0.60439: fp16 halves the 13 compressed steps, the
    # engine's opening check adds 8 bytes to each dense step and its closing report 104 to each compressed one
    assert "ratio 0.6044" in text and "1.7x less" in text


def test_summary_printed_once_at_end_of_fit(fp16_run):
    """The GCMonitor prints the block on rank zero only (both ranks' stderr went to one file)."""
    tmp, _ = fp16_run
    out = (tmp / "stderr.txt").read_text()
    assert out.count("lightning_gc summary (rank 0 of 2): compressor=fp16 collective=allreduce") == 1, out[-3000:]
    assert "rank 1 of 2" not in out
    assert "optimizer steps: 16 (13 compressed, 3 dense)" in out
    assert "(ratio 0.6044, 1.7x less)" in out  # see test_summary_text_states_the_counts


def test_warmup_end_visible_in_tensorboard_with_sparse_logging(fp16_run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    tmp, _ = fp16_run
    runs = list((tmp / "tb").glob("version_*"))
    assert len(runs) == 1
    acc = EventAccumulator(str(runs[0]))
    acc.Reload()
    dense = {e.step: e.value for e in acc.Scalars("gc/dense_step")}
    # log_every_n_steps=50 and 16 steps: Lightning itself would write no training step at all;
    # the steps where the mode changes are written anyway: the first (dense) and the first compressed
    assert dense == {0: 1.0, WARMUP: 0.0}, dense
    ratios = {e.step: e.value for e in acc.Scalars("gc/bytes_ratio")}
    # fp32 ring allreduce = 8080 bytes; + 8 (opening check); fp16 step + 104 (closing report, no opening check)
    assert sorted(ratios) == [0, WARMUP]
    assert ratios[0] == pytest.approx(8088 / 8080) and ratios[WARMUP] == pytest.approx(4144 / 8080)


def test_gc_ratio_on_fp16_steps_is_the_payload_fraction(fp16_run):
    """fp16 has no ratio option: gc/ratio is the fraction of the fp32 payload sent, 2/4 bytes."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    tmp, _ = fp16_run
    acc = EventAccumulator(str(next((tmp / "tb").glob("version_*"))))
    acc.Reload()
    assert {e.step: e.value for e in acc.Scalars("gc/ratio")} == {0: 1.0, WARMUP: 0.5}


# ---------------------------------------------------------------- honest counters: what each step really sent
GQ_ARGS = dict(max_slice=64, min_numel=100, warmup=3, sample_steps=2, compress_steps=2, loss_threshold=None,
               pca_slices=4, sample_levels=7, sample_bucket=512)
GQ_STEPS = 11
# by hand from the schedule: steps 0-2 the compressor's exact warm-up, then 2 sample steps and 2
# compressed steps, alternating: 3-4 sample, 5-6 compressed, 7-8 sample, 9-10 compressed
GQ_MODES = ["dense"] * 3 + ["sample"] * 2 + ["compressed"] * 2 + ["sample"] * 2 + ["compressed"] * 2
MARSIT_K, MARSIT_STEPS = 3, 7  # full-precision rounds at steps 0, 3, 6 (step 0 is the engine warm-up too)


def _counted_run(rank: int, ws: int) -> dict:
    from torch.nn.parallel import DistributedDataParallel as DDP

    from lightning_gc.callbacks.monitor import step_metrics
    from lightning_gc.engine import EngineConfig, GCEngine, gc_comm_hook
    from lightning_gc.summary import summarize

    out = {}
    for name, args, steps in (("gradiveq", GQ_ARGS, GQ_STEPS), ("marsit", {"full_precision_every": MARSIT_K},
                                                                 MARSIT_STEPS)):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), torch.nn.Tanh(), torch.nn.Flatten(),
                                    torch.nn.Linear(128, 5))
        ddp = DDP(model)
        engine = GCEngine(build_compressor(name, args=args), EngineConfig(warmup_steps=1, min_compress_numel=1),
                          list(model.named_parameters()))
        ddp.register_comm_hook(engine, gc_comm_hook)
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        per_step = []
        for step in range(steps):
            g = torch.Generator().manual_seed(1000 * rank + step)
            x, y = torch.randn(8, 3, 6, 6, generator=g) * (1 + rank), torch.randint(0, 5, (8,), generator=g)
            opt.zero_grad()
            torch.nn.functional.cross_entropy(ddp(x), y).backward()
            s = engine.last_step
            per_step.append({"mode": s.mode, "metrics": step_metrics(engine, s), "payload": s.bytes_payload})
            opt.step()
        out[name] = {"steps": per_step, "totals": engine.totals(), "summary": summarize(engine, name, 0).as_dict(),
                     "numel": sum(p.numel() for p in model.parameters())}
        engine.close()
    return out


@pytest.fixture(scope="module")
def counted_runs():
    return run_distributed(_counted_run, 2, timeout=180)


def test_gradiveq_warmup_and_sample_steps_are_not_counted_as_compressed(counted_runs):
    for res in counted_runs:
        gq = res["gradiveq"]
        assert [s["mode"] for s in gq["steps"]] == GQ_MODES
        n_dense, n_sample, n_comp = (GQ_MODES.count(m) for m in ("dense", "sample", "compressed"))
        t, s = gq["totals"], gq["summary"]
        assert (t["steps"], t["compressed_steps"], t["sample_steps"]) == (GQ_STEPS, n_comp, n_sample)
        assert (s["compressed_steps"], s["sample_steps"], s["dense_steps"]) == (n_comp, n_sample, n_dense)
        from lightning_gc.summary import GCSummary

        assert f"optimizer steps: {GQ_STEPS} ({n_comp} compressed, {n_sample} sample, {n_dense} dense)" in \
            GCSummary(**s).format()
        for mode, step in zip(GQ_MODES, gq["steps"]):
            m = step["metrics"]
            assert m["gc/dense_step"] == float(mode == "dense")
            assert m["gc/sample_step"] == float(mode == "sample")
            dense_payload = 4 * gq["numel"]  # fp32 gradient bytes of the whole model
            if mode == "dense":
                assert m["gc/ratio"] == 1.0 and step["payload"] == dense_payload
            elif mode == "sample":
                # 4-bit QSGD (7 levels): half a byte per element plus one fp32 norm per 512-element bucket
                assert m["gc/ratio"] == pytest.approx((0.5 + 4 / 512) / 4, rel=0.03)
            else:
                # bf16 coefficients: 2 bytes per coefficient, gradiveq/ratio coefficients per element
                assert m["gc/ratio"] == pytest.approx(m["gc/gradiveq/ratio"] * 2 / 4, rel=1e-6)
                assert m["gc/ratio"] < 0.5


def test_marsit_full_precision_rounds_are_counted_as_dense(counted_runs):
    for res in counted_runs:
        ma = res["marsit"]
        fp = [s % MARSIT_K == 0 for s in range(MARSIT_STEPS)]
        assert [s["mode"] for s in ma["steps"]] == ["dense" if f else "compressed" for f in fp]
        assert [s["metrics"]["gc/dense_step"] for s in ma["steps"]] == [float(f) for f in fp]
        s = ma["summary"]
        assert (s["compressed_steps"], s["sample_steps"], s["dense_steps"]) == (fp.count(False), 0, fp.count(True))
        for f, step in zip(fp, ma["steps"]):
            # one bit per element on one-bit rounds (bytes of packed signs), fp32 on full-precision rounds
            assert step["metrics"]["gc/ratio"] == (1.0 if f else pytest.approx(1 / 32, rel=0.05))


@pytest.mark.parametrize("world_size", [2, 3, 4, 8])
def test_payload_fraction_undoes_the_ring_factor(world_size):
    """gc/ratio of a step without a ratio option: payload bytes over the fp32 gradient bytes M, where
    bytes_dense holds the ring's 2(N−1)/N·M (by hand: a payload of M/2 is 0.5 at any N)."""
    from lightning_gc.callbacks.monitor import payload_fraction
    from lightning_gc.engine.stats import StepStats

    m = 4 * 1000  # fp32 gradient bytes
    s = StepStats(dense=False, bytes_payload=m // 2, bytes_dense=round(2 * (world_size - 1) / world_size * m))
    assert payload_fraction(s, world_size) == pytest.approx(0.5, rel=1e-3)
    assert payload_fraction(s, 1) == 1.0  # nothing communicated
