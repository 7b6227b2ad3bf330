"""What a newcomer meets first: names and refusals of the CLI and registry, recipe errors through the
real `lightning-gc fit`, and what the end-of-fit summary and GCMonitor say about OSP, DiLoCo and auto."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import lightning as L
import pytest
import torch
import yaml
from lit_models import TinyClassifier, make_loader

from lightning_gc import GCStrategy
from lightning_gc.cli import (
    RECIPES,
    help_text,
    lightning_cli_class,
    list_text,
    strategy_refusal,
    unknown_option_refusal,
)
from lightning_gc.compressors import available_compressors, compressor_choices, get_entry
from lightning_gc.summary import GCSummary, auto_decisions

REPO = Path(__file__).resolve().parents[1]


# ---------------------------------------------------------------- names: auto everywhere, did-you-mean
@pytest.mark.parametrize(("typed", "meant"), [("topkk", "topk"), ("autoo", "auto"), ("Auto", "auto"),
                                              ("lowrnk", "lowrank"), ("top_k", "topk")])
def test_unknown_compressor_names_the_closest_choice_auto_included(typed, meant):
    with pytest.raises(ValueError, match=rf"unknown compressor '{typed}'.*'auto'.*Did you mean '{meant}'\?"):
        GCStrategy(compressor=typed)


def test_a_name_close_to_nothing_gets_no_guess():
    with pytest.raises(ValueError, match="unknown compressor 'xyz'") as err:
        GCStrategy(compressor="xyz")
    assert "Did you mean" not in str(err.value)


def test_auto_where_one_compressor_is_needed_says_what_auto_is():
    with pytest.raises(ValueError, match="run-time chooser of GCStrategy"):
        get_entry("auto")
    with pytest.raises(ValueError, match="osp_deferred_compressor='auto'.*run-time chooser"):
        GCStrategy(sync="osp", osp_deferred_compressor="auto")


def test_auto_is_listed_wherever_compressors_are():
    assert compressor_choices() == [*available_compressors(), "auto"]
    GCStrategy(compressor="auto")  # every listed choice is accepted by the strategy
    lines = list_text().splitlines()
    section = lines[lines.index("compressors (GCStrategy(compressor=NAME); default collective in brackets):") + 1:]
    section = section[:next(i for i, ln in enumerate(section) if not ln.startswith("  "))]
    assert [ln.split()[0] for ln in section] == compressor_choices()
    auto_line = section[-1]
    assert "run time" in auto_line and "docs/auto.md" in auto_line
    text = help_text()
    listed = text[text.index("compressors") + len("compressors"):text.index("(Top-k family")]
    assert [n.strip() for n in listed.replace("\n", " ").split(",")] == compressor_choices()


def test_help_names_every_recipe_of_the_directory():
    """The recipes directory holds one recipe per compressor plus those RECIPES names, no more, no
    fewer, and `--help` names each of the latter."""
    on_disk = {p.name for p in (REPO / "recipes").glob("*.yaml")}
    expected = {f"{c}.yaml" for c in available_compressors()} | set(RECIPES)
    assert on_disk == expected, (f"recipes missing from lightning_gc/cli.py RECIPES: {sorted(on_disk - expected)}; "
                                 f"named but absent: {sorted(expected - on_disk)}")
    text = help_text()
    for name, what in RECIPES.items():
        assert f"{name}" in text and what in text, name


# ---------------------------------------------------------------- recipe errors: the project's message first
def _bad_recipe(tmp_path: Path, recipe: str = "topk.yaml", **init_args) -> Path:
    cfg = yaml.safe_load((REPO / "recipes" / recipe).read_text())
    cfg["trainer"]["strategy"]["init_args"].update(init_args)
    cfg["trainer"]["logger"] = False
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def test_misspelt_compressor_through_the_real_command_is_refused_first(tmp_path):
    path = _bad_recipe(tmp_path, compressor="topkk")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, "-m", "lightning_gc.cli", "fit", "--config", str(path)], cwd=tmp_path,
                          env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr[-3000:]
    first, second = proc.stderr.splitlines()[:2]
    assert first.startswith("lightning-gc: unknown compressor 'topkk'") and "Did you mean 'topk'?" in first, first
    assert str(path) in second and "--trainer.strategy.init_args" in second, second
    assert "Expected a <class 'str'>" not in proc.stderr


def test_ratio_zero_in_a_recipe_is_refused_with_value_reason_and_fix(tmp_path, capsys):
    path = _bad_recipe(tmp_path, ratio=0)
    with pytest.raises(SystemExit) as code:
        lightning_cli_class()(args=["fit", "--config", str(path)])
    assert code.value.code == 2
    first = capsys.readouterr().err.splitlines()[0]
    assert first.startswith("lightning-gc: ratio=0") and "(0, 1]" in first and "e.g. ratio=0.01" in first, first


@pytest.mark.parametrize("recipe, option, refusal, hint", [
    ("topk.yaml", {"ratoi": 0.01}, "GCStrategy got an unknown keyword argument ratoi=0.01", "Did you mean ratio=?"),
    ("fsdp.yaml", {"replicat_size": 2}, "GCModelParallelStrategy got an unexpected argument 'replicat_size'",
     "Did you mean replicate_size=?"),
], ids=["ddp", "fsdp2"])
def test_misspelt_option_name_in_a_recipe_is_refused_first_with_the_closest_name(tmp_path, capsys, recipe, option,
                                                                                 refusal, hint):
    path = _bad_recipe(tmp_path, recipe, **option)
    with pytest.raises(SystemExit) as code:
        lightning_cli_class()(args=["fit", "-c", str(path)])
    assert code.value.code == 2
    first = capsys.readouterr().err.splitlines()[0]
    assert first.startswith(f"lightning-gc: {refusal}"), first
    assert hint in first


@pytest.mark.parametrize("recipe", sorted((REPO / "recipes").glob("*.yaml")), ids=lambda p: p.stem)
def test_every_recipe_passes_the_early_checks(recipe):
    from jsonargparse import dict_to_namespace

    block = yaml.safe_load(recipe.read_text())["trainer"]["strategy"]
    assert unknown_option_refusal(block) is None
    assert strategy_refusal(dict_to_namespace(block)) is None
    bad = dict_to_namespace({**block, "init_args": {**block["init_args"], "collective": "nope"}})
    assert "nope" in strategy_refusal(bad)


def test_the_early_check_leaves_other_strategies_alone():
    from jsonargparse import Namespace

    assert strategy_refusal(Namespace(class_path="lightning.pytorch.strategies.DDPStrategy",
                                      init_args=Namespace(timeout=None))) is None
    assert strategy_refusal("ddp") is None and strategy_refusal(None) is None


# ---------------------------------------------------------------- summary: auto in plain words
def _pred(step_ms: float, tpp_ms: float) -> dict:
    return {"step_s": step_ms / 1e3, "time_per_progress_s": tpp_ms / 1e3, "details": {}}


def test_auto_runner_up_is_the_best_other_method_not_the_pick():
    """A margin held 'fp16' although 'ddp' led it by a little: the runner-up is 'ddp', and when the
    pick is the model's minimum it is the second."""
    history = [
        {"step": 2, "trigger": "warmup", "chosen": "ddp",
         "predictions": {"ddp": _pred(20, 20), "fp16": _pred(21, 22), "topk": _pred(30, 40)}},
        {"step": 40, "trigger": "calibration", "chosen": "fp16", "measured_step_s": 0.0205,
         "predictions": {"ddp": _pred(19, 19), "fp16": _pred(20, 20), "topk": _pred(25, 30)}},
    ]
    got = auto_decisions(history)
    assert [d["runner_up"] for d in got] == ["fp16", "ddp"]
    assert [d["runner_up_step_s"] for d in got] == [0.021, 0.019]
    text = GCSummary(compressor="auto", collective="allgather", world_size=2, rank=0, steps=50, compressed_steps=0,
                     sample_steps=0, dense_steps=50, bytes_sent=1, bytes_dense=1, bytes_ratio=1.0,
                     compress_time_s=0.0, comm_time_s=0.0, nonfinite_steps=0, skipped_steps=0,
                     auto_decisions=got).format()
    assert "re-decided after measuring the method's real step" in text
    assert "chose 'fp16', predicted 20.0 ms/step, measured 20.5 ms; best other method 'ddp', predicted 19.0" in text
    assert "(calibration)" not in text and "(family)" not in text and "runner-up" not in text


# ---------------------------------------------------------------- real runs: DiLoCo and OSP on 2 ranks
H = 4  # DiLoCo's inner steps = log_every_n_steps: every written step is an outer step
STEPS = 16  # 256 samples / 2 ranks / batch 16 = 8 steps per epoch, 2 epochs


class _Record(L.Callback):
    """Per optimizer step, what OSP and DiLoCo report about that step; at the end, the summary."""

    def __init__(self, out_dir: str) -> None:
        self.out_dir, self.osp_fractions, self.diloco_comm = out_dir, [], []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        s = trainer.strategy
        if s.osp is not None:
            self.osp_fractions.append(s.osp.last_stats.deferred_fraction)
        d = s.diloco
        if d is not None and d.last_stats is not None and d.last_stats.inner_step == d.inner_step:
            self.diloco_comm.append(d.last_stats.comm_s)

    def on_fit_end(self, trainer, pl_module):
        s = trainer.strategy
        torch.save({"summary": s.summary().as_dict(), "text": s.summary().format(), "totals": s.engine.totals(),
                    "numel": sum(p.numel() for p in pl_module.parameters()), "osp_fractions": self.osp_fractions,
                    "diloco_comm": self.diloco_comm},
                   os.path.join(self.out_dir, f"rank{trainer.global_rank}.pt"))


def _fit(tmp: Path, strategy: GCStrategy, log_every: int) -> list[dict]:
    from lightning.pytorch.loggers import TensorBoardLogger

    trainer = L.Trainer(strategy=strategy, accelerator="cpu", devices=2, max_epochs=2, log_every_n_steps=log_every,
                        enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
                        logger=TensorBoardLogger(str(tmp), name="tb"), callbacks=[_Record(str(tmp))])
    trainer.fit(TinyClassifier(momentum=0.0), make_loader())
    return [torch.load(tmp / f"rank{r}.pt", weights_only=False) for r in range(2)]


def _scalars(tmp: Path, tag: str) -> list[float]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(tmp / "tb" / "version_0"), size_guidance={"scalars": 0})
    acc.Reload()
    return [e.value for e in acc.Scalars(tag)]


@pytest.mark.slow
def test_diloco_bytes_in_tensorboard_average_to_the_true_bytes_per_step_and_summary_times_the_exchanges(tmp_path):
    """H = log_every_n_steps = 4 over 16 steps: every written step is an outer step. The written
    gc/bytes_sent must still average to the bytes the engine counted over the run divided by the steps
    (a per-step value would show 4x that), and the summary's communication time is the sum of the
    outer exchanges' times each outer step reported."""
    res = _fit(tmp_path, GCStrategy(sync="diloco", compressor="topk", diloco_inner_steps=H, start_method="forkserver"),
               log_every=H)
    sent = _scalars(tmp_path, "gc/bytes_sent")
    assert len(sent) == STEPS // H
    true_per_step = res[0]["totals"]["bytes_sent"] / STEPS
    assert true_per_step > 0 and sum(sent) / len(sent) == pytest.approx(true_per_step, rel=1e-6)
    dense = _scalars(tmp_path, "gc/bytes_dense")
    assert dense == [pytest.approx(4 * res[0]["numel"])] * len(dense)  # fp32 ring allreduce, 2 ranks: 4 B/element
    for r in res:
        s = r["summary"]
        assert s["outer_steps"] == STEPS // H == len(r["diloco_comm"])
        assert s["comm_time_s"] > 0 and s["comm_time_s"] == pytest.approx(sum(r["diloco_comm"]), rel=1e-9)
    assert "communication 0.000 s" not in res[0]["text"] and "(the outer exchanges)" in res[0]["text"]


@pytest.mark.slow
def test_osp_summary_names_the_deferred_share_and_its_bytes(tmp_path):
    """OSP with half the model deferred (dense deferred stage): the summary's deferred bytes are the
    fp32 ring allreduce of every step's deferred elements (2 ranks: 4 bytes per element), its mean
    fraction the mean of what each step reported, and the text says so."""
    res = _fit(tmp_path, GCStrategy(sync="osp", compressor="topk", osp_deferred_fraction=0.5, osp_round_steps=4,
                                    start_method="forkserver"), log_every=50)
    for r in res:
        fractions, osp = r["osp_fractions"], r["summary"]["osp"]
        assert len(fractions) == STEPS and max(fractions) > 0
        deferred_elements = [round(f * r["numel"]) for f in fractions]
        assert osp["steps"] == STEPS
        assert osp["deferred_bytes"] == 4 * sum(deferred_elements)
        assert osp["deferred_fraction"] == pytest.approx(sum(fractions) / STEPS)
        assert 0 < osp["deferred_bytes"] < r["summary"]["bytes_sent"]
    assert "OSP (sync='osp')" in res[0]["text"] and f"{res[0]['summary']['osp']['deferred_fraction']:.1%}" in res[0]["text"]
