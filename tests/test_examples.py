"""Tests for the demo workloads in ``lightning_gc.examples``.

All single-process and small: tiny widths / sample counts keep the whole file to a few seconds of
CPU. Oracles are exact parameter counts (closed-form or the published ResNet-18 number), bitwise
determinism of generated data and of model construction, and a decreasing training loss.
"""

from __future__ import annotations

import os
import textwrap

import lightning as L
import pytest
import torch
from lightning.pytorch.cli import LightningCLI

from lightning_gc.examples import (
    PRESETS,
    ByteLM,
    MLPClassifier,
    ResNet18Classifier,
    StdlibTextData,
    SyntheticImageData,
    TeacherClassificationData,
    describe_presets,
    get_preset,
)
from lightning_gc.examples.language import load_stdlib_corpus, stdlib_source_files


@pytest.fixture(autouse=True)
def one_thread():
    """Run each test on one intra-op thread, restoring the setting afterwards.

    On a small, shared machine the default (one thread per core) oversubscribes the CPUs and makes
    the tiny matrix products here several times slower; results do not depend on the setting.
    """
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def n_params(module: torch.nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


class LossRecorder(L.Callback):
    """Collects the per-step ``train_loss`` the module logs."""

    def __init__(self) -> None:
        self.losses: list[float] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.losses.append(float(trainer.callback_metrics["train_loss"]))


def quiet_trainer(tmp_path, **kwargs) -> L.Trainer:
    return L.Trainer(
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=str(tmp_path),
        **kwargs,
    )


# ------------------------------------------------------------------------------ parameter counts


def test_mlp_parameter_count_matches_closed_form():
    model = MLPClassifier(num_features=64, num_classes=10, hidden=[256, 256])
    assert n_params(model) == (64 * 256 + 256) + (256 * 256 + 256) + (256 * 10 + 10) == 85_002


def test_resnet18_has_the_standard_parameter_count_and_scales_with_width():
    full = ResNet18Classifier(num_classes=10, width=64)
    assert n_params(full) == 11_173_962  # the CIFAR ResNet-18 every compression paper reports
    small = ResNet18Classifier(num_classes=10, width=8)
    # Same tensors (conv/BN/fc structure), ~width^2 fewer weights.
    assert len(list(small.parameters())) == len(list(full.parameters()))
    assert n_params(small) < n_params(full) / 50
    assert small(torch.zeros(2, 3, 32, 32)).shape == (2, 10)


def test_bytelm_parameter_count_matches_closed_form():
    e, h = 16, 32
    model = ByteLM(embed_dim=e, hidden_size=h, num_layers=2)
    lstm = 4 * (h * e + h * h + 2 * h) + 4 * (h * h + h * h + 2 * h)
    assert n_params(model) == 256 * e + lstm + (h * 256 + 256)
    assert model(torch.zeros(3, 7, dtype=torch.long)).shape == (3, 7, 256)


def test_preset_parameter_counts_are_in_the_documented_ranges():
    rows = {row["name"]: row for row in describe_presets()}
    assert set(rows) == set(PRESETS) == {"quickstart", "mlp", "cnn", "lm", "gpt"}
    assert rows["quickstart"]["params"] == 85_002
    assert 800_000 <= rows["mlp"]["params"] <= 1_300_000
    assert 10_500_000 <= rows["cnn"]["params"] <= 12_000_000
    assert 100_000 <= rows["lm"]["params"] <= 2_000_000
    for row in rows.values():
        assert row["mode"] in ("max", "min") and row["batch_size"] > 0


# ------------------------------------------------------------------------------ data


def test_teacher_data_is_deterministic_balanced_and_split():
    kwargs = dict(num_features=16, num_classes=5, num_train=512, num_val=128)
    x1, y1 = TeacherClassificationData(**kwargs, seed=1).generate("train")
    x2, y2 = TeacherClassificationData(**kwargs, seed=1).generate("train")
    x3, y3 = TeacherClassificationData(**kwargs, seed=2).generate("train")
    xv, _ = TeacherClassificationData(**kwargs, seed=1).generate("val")
    assert (
        x1.shape == (512, 16) and x1.dtype == torch.float32 and y1.shape == (512,) and y1.dtype == torch.int64
    )
    assert torch.equal(x1, x2) and torch.equal(y1, y2)
    assert not torch.equal(x1, x3)
    assert xv.shape == (128, 16) and not torch.equal(xv, x1[:128])
    counts = torch.bincount(y1, minlength=5)
    assert int(counts.min()) >= 0.05 * 512, counts  # centring keeps every class represented


def test_teacher_labels_follow_the_teacher_and_label_noise_flips_them():
    clean = TeacherClassificationData(num_features=16, num_train=2000, margin_quantile=0.5, seed=0)
    x, y = clean.generate("train")
    assert torch.equal(y, clean.teacher_logits(x).argmax(dim=1))
    noisy = TeacherClassificationData(
        num_features=16, num_train=2000, margin_quantile=0.5, label_noise=1.0, seed=0
    )
    xn, yn = noisy.generate("train")
    assert torch.equal(xn, x)  # noise touches labels only
    agreement = (yn == y).float().mean().item()
    assert 0.05 < agreement < 0.2  # uniform relabelling agrees ~1/num_classes of the time


def test_synthetic_images_are_deterministic():
    kwargs = dict(num_train=48, num_val=16)
    x1, y1 = SyntheticImageData(**kwargs, seed=0).generate("train")
    x2, y2 = SyntheticImageData(**kwargs, seed=0).generate("train")
    x3, _ = SyntheticImageData(**kwargs, seed=1).generate("train")
    xv, yv = SyntheticImageData(**kwargs, seed=0).generate("val")
    assert x1.shape == (48, 3, 32, 32) and y1.shape == (48,) and int(y1.max()) < 10
    assert torch.equal(x1, x2) and torch.equal(y1, y2)
    assert not torch.equal(x1, x3)
    assert xv.shape == (16, 3, 32, 32) and not torch.equal(xv, x1[:16])
    assert torch.isfinite(x1).all()


def test_stdlib_text_is_real_text_and_deterministic():
    dm = StdlibTextData(seq_len=32, max_bytes=150_000, val_fraction=0.2, seed=0)
    train, val = dm.corpus()
    assert len(train) + len(val) <= 150_000 and len(val) > 0
    text = train.decode("utf-8")  # whole corpus is valid UTF-8
    assert "def " in text and "return" in text and "import" in text
    printable = sum(c.isprintable() or c in "\n\t" for c in text) / len(text)
    assert printable > 0.99

    x, y = dm.generate("train")
    assert x.shape[1] == 32 and x.dtype == torch.int64 and x.shape == y.shape
    assert torch.equal(x[:, 1:], y[:, :-1])  # targets are the inputs shifted by one byte
    assert int(x.max()) < 256 and int(x.min()) >= 0
    x_again, _ = StdlibTextData(seq_len=32, max_bytes=150_000, val_fraction=0.2, seed=0).generate("train")
    x_other, _ = StdlibTextData(seq_len=32, max_bytes=150_000, val_fraction=0.2, seed=1).generate("train")
    assert torch.equal(x, x_again)
    assert not torch.equal(x[: len(x_other)], x_other[: len(x)])  # other seed: other window alignment
    xv, _ = dm.generate("val")
    assert xv.shape[1] == 32 and len(xv) > 0


def test_stdlib_corpus_skips_bad_files_and_excluded_directories(tmp_path):
    (tmp_path / "a_good.py").write_text("def f():\n    return 1\n" * 50)
    (tmp_path / "b_latin1.py").write_bytes(b"x = '\xe9\xe9'\n" * 50)  # not UTF-8: skipped
    (tmp_path / "c_broken.py").symlink_to(tmp_path / "missing.py")  # unreadable: skipped
    (tmp_path / "test").mkdir()
    (tmp_path / "test" / "test_x.py").write_text("SHOULD_NOT_APPEAR = 1\n")
    names = [p.name for p in stdlib_source_files(str(tmp_path))]
    assert names == ["a_good.py", "b_latin1.py", "c_broken.py"]
    train, val = load_stdlib_corpus(10_000, 0.5, stdlib_dir=str(tmp_path))
    corpus = train + val
    assert b"return 1" in corpus and b"\xe9" not in corpus and b"SHOULD_NOT_APPEAR" not in corpus


def test_missing_stdlib_sources_raise_a_clear_error(tmp_path):
    missing = tmp_path / "no_such_dir"
    with pytest.raises(FileNotFoundError, match="no_such_dir.*stdlib_dir"):
        StdlibTextData(stdlib_dir=str(missing)).setup()
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(FileNotFoundError, match="No .py files"):
        StdlibTextData(stdlib_dir=str(empty)).setup()


# ------------------------------------------------------------------------------ training


def test_quickstart_fit_lowers_training_loss_and_logs_val_acc(tmp_path):
    # A larger lr than the quickstart's 0.005 (tuned for 5 full epochs) so that 96 steps suffice.
    preset = get_preset("quickstart", seed=0, num_train=2048, num_val=512, lr=0.05)
    recorder = LossRecorder()
    trainer = quiet_trainer(tmp_path, max_steps=96, callbacks=[recorder], num_sanity_val_steps=0)
    trainer.fit(preset.model, preset.datamodule)
    losses = recorder.losses
    assert len(losses) == 96
    first, last = sum(losses[:10]) / 10, sum(losses[-10:]) / 10
    assert last < 0.6 * first, (first, last)
    metrics = trainer.callback_metrics
    assert {"train_loss", "val_loss", "val_acc"} <= set(metrics)
    assert float(metrics["val_acc"]) > 0.3  # chance is 0.1


@pytest.mark.parametrize("name", ["cnn", "lm"])
def test_small_cnn_and_lm_train_and_validate(tmp_path, name):
    if name == "cnn":
        preset = get_preset(name, width=4, num_train=32, num_val=16, batch_size=8)
    else:
        preset = get_preset(
            name, hidden_size=32, embed_dim=8, max_bytes=150_000, val_fraction=0.2, seq_len=32, batch_size=8
        )
    trainer = quiet_trainer(tmp_path, max_steps=3, limit_val_batches=2, num_sanity_val_steps=0)
    trainer.fit(preset.model, preset.datamodule)
    trainer.validate(preset.model, preset.datamodule, verbose=False)
    metrics = trainer.callback_metrics
    assert preset.metric in metrics and torch.isfinite(metrics[preset.metric])
    if name == "lm":
        # bits per byte = nats per byte / ln 2, and an untrained byte model is near 8 bits.
        assert float(metrics["val_bpb"]) == pytest.approx(
            float(metrics["val_loss"]) / 0.6931471805599453, rel=1e-5
        )
        assert 4.0 < float(metrics["val_bpb"]) < 8.5


# ------------------------------------------------------------------------------ presets & config


def test_get_preset_is_deterministic_and_routes_overrides():
    a = get_preset("mlp", seed=3)
    b = get_preset("mlp", seed=3)
    c = get_preset("mlp", seed=4)
    sa, sb, sc = a.model.state_dict(), b.model.state_dict(), c.model.state_dict()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert not all(torch.equal(sa[k], sc[k]) for k in sa)
    assert a.datamodule.hparams.seed == 3 and c.datamodule.hparams.seed == 4

    rng_before = torch.random.get_rng_state()
    p = get_preset("quickstart", num_classes=4, batch_size=32, lr=0.1, target=0.5)
    assert torch.equal(torch.random.get_rng_state(), rng_before)  # global RNG untouched
    assert p.model.hparams.num_classes == 4 and p.datamodule.hparams.num_classes == 4
    assert p.batch_size == 32 and p.datamodule.hparams.batch_size == 32
    assert p.model.hparams.lr == 0.1 and p.target == 0.5 and p.reached(0.6) and not p.reached(0.4)


def test_unknown_preset_and_override_errors_name_the_valid_choices():
    with pytest.raises(ValueError, match=r"'resnet'.*\['cnn', 'gpt', 'lm', 'mlp', 'quickstart'\]"):
        get_preset("resnet")
    with pytest.raises(ValueError, match="'depth'.*hidden"):
        get_preset("mlp", depth=3)


def test_optimizer_argument_is_validated():
    with pytest.raises(ValueError, match="'adamw'.*sgd.*adam"):
        MLPClassifier(optimizer="adamw")
    with pytest.raises(ValueError, match="lr=-1"):
        ByteLM(lr=-1.0)
    assert isinstance(MLPClassifier(optimizer="adam", lr=1e-3).configure_optimizers(), torch.optim.Adam)
    sgd = ResNet18Classifier(width=4, momentum=0.8).configure_optimizers()
    assert isinstance(sgd, torch.optim.SGD) and sgd.param_groups[0]["momentum"] == 0.8


@pytest.mark.parametrize(
    "model_yaml, data_yaml",
    [
        (
            "MLPClassifier\n  init_args:\n    hidden: [32, 16]\n    num_features: 8",
            "TeacherClassificationData\n  init_args:\n    num_features: 8\n    seed: 5",
        ),
        (
            "ResNet18Classifier\n  init_args:\n    width: 4",
            "SyntheticImageData\n  init_args:\n    batch_size: 4",
        ),
        (
            "ByteLM\n  init_args:\n    hidden_size: 16\n    optimizer: adam\n    lr: 0.001",
            "StdlibTextData\n  init_args:\n    seq_len: 16",
        ),
    ],
    ids=["mlp", "resnet", "lm"],
)
def test_workloads_instantiate_from_lightning_cli_yaml(tmp_path, monkeypatch, model_yaml, data_yaml):
    config = tmp_path / "config.yaml"
    config.write_text(
        textwrap.dedent(
            """\
            trainer:
              accelerator: cpu
              logger: false
              default_root_dir: {root}
            model:
              class_path: lightning_gc.examples.{model}
            data:
              class_path: lightning_gc.examples.{data}
            """
        ).format(root=os.fspath(tmp_path), model=model_yaml, data=data_yaml)
    )
    monkeypatch.setattr("sys.argv", ["lightning-gc-test"])  # pytest's own argv is not for the CLI
    cli = LightningCLI(run=False, args=["--config", str(config)], save_config_callback=None)
    if isinstance(cli.model, MLPClassifier):
        assert list(cli.model.hparams.hidden) == [32, 16] and cli.datamodule.hparams.seed == 5
        assert n_params(cli.model) == (8 * 32 + 32) + (32 * 16 + 16) + (16 * 10 + 10)
    assert cli.trainer is not None and cli.datamodule is not None


def test_measure_module_runs_its_loops_and_refuses_an_empty_timing():
    """docs/workloads.md quotes `python -m lightning_gc.examples.measure`; keep it runnable."""
    from lightning_gc.examples import measure

    lines: list[str] = []
    out = measure.synthetic_images(width=2, steps=50, epochs=1, num_train=128, log=lines.append)
    assert [e for e, _ in out["linear"]] == [1] and [s for s, _ in out["resnet"]] == [50]
    assert all(0.0 <= acc <= 1.0 for _, acc in out["linear"] + out["resnet"]) and len(lines) == 2
    with pytest.raises(ValueError, match="steps=2 must exceed untimed=2"):
        measure.step_time("quickstart", steps=2)
    assert measure.step_time("quickstart", steps=3, log=lines.append) > 0 and "quickstart 32-true" in lines[-1]
