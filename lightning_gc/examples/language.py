"""Byte-level language modelling on the Python standard library's own source text (``lm`` preset).

Why this corpus: it is real text (Python code plus English comments and docstrings), it ships with
every Python installation, so nothing is downloaded, and reading it needs no tokenizer: bytes are
the vocabulary (256 symbols). The corpus is fixed for a given Python version; a different Python
minor version ships slightly different files, so absolute loss values can differ a little between
interpreter versions (never between the ranks of one run).

Why an LSTM rather than a tiny transformer: the workloads default to plain momentum SGD, which
trains LSTM language models well (with gradient clipping) but trains transformers poorly without
Adam and warm-up; an LSTM LM is also the language workload used in the PowerSGD paper, and its
large gate matrices are a realistic target for low-rank and sparse compressors.
"""

from __future__ import annotations

import math
import os
import sysconfig
from pathlib import Path

import lightning as L
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Dataset

from .classification import (
    _check_positive,
    build_optimizer,
    stream_generator,
    train_loader,
    val_loader,
    validate_optimizer_args,
)

__all__ = ["StdlibTextData", "ByteLM", "stdlib_source_files", "load_stdlib_corpus"]

# Directories skipped while collecting stdlib sources: third-party packages, the test suites (which
# contain deliberately malformed and machine-generated inputs), caches, and the codec tables in
# ``encodings`` (thousands of lines of hex character maps, not language).
_EXCLUDED_DIRS = frozenset(
    {
        "site-packages",
        "dist-packages",
        "test",
        "tests",
        "idle_test",
        "__pycache__",
        "lib-dynload",
        "encodings",
    }
)


def _default_stdlib_dir() -> str:
    return sysconfig.get_paths()["stdlib"]


def stdlib_source_files(stdlib_dir: str | None = None) -> list[Path]:
    """The standard library's ``.py`` files in a deterministic order (sorted by relative POSIX path).

    ``_sysconfigdata*`` modules are left out because they record this interpreter's build paths,
    which would make the corpus machine-specific. Raises ``FileNotFoundError`` with the reason when
    the sources are absent (e.g. an embedded or "optimised" Python that ships only ``.pyc`` files).
    """
    root = Path(stdlib_dir if stdlib_dir is not None else _default_stdlib_dir())
    if not root.is_dir():
        raise FileNotFoundError(
            f"Standard-library directory {str(root)!r} does not exist, so StdlibTextData has no text to "
            "read. It is taken from sysconfig.get_paths()['stdlib']; pass `stdlib_dir` pointing at a "
            "directory of Python sources, or use a Python installation that ships its .py files."
        )
    files = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in _EXCLUDED_DIRS and not d.startswith("config-")]
        for name in filenames:
            if name.endswith(".py") and not name.startswith("_sysconfigdata"):
                files.append(Path(dirpath) / name)
    files.sort(key=lambda p: p.relative_to(root).as_posix())
    if not files:
        raise FileNotFoundError(
            f"No .py files found under {str(root)!r}: this Python installation appears to ship only "
            "compiled modules, so StdlibTextData has no text to read. Pass `stdlib_dir` pointing at "
            "a directory of Python sources."
        )
    return files


def load_stdlib_corpus(
    max_bytes: int, val_fraction: float, stdlib_dir: str | None = None
) -> tuple[bytes, bytes]:
    """Read up to ``max_bytes`` of stdlib text and split it into ``(train, val)`` byte strings.

    Files are taken in sorted order until the budget is used up (the last one is truncated). Each
    file goes entirely to one side, so no text leaks between train and val: a file goes to val
    if val would then still hold at most ``val_fraction`` of the bytes read so far, otherwise to
    train. This keeps the val share just below ``val_fraction`` at any budget (a large file can
    never swamp val), spreads val files over the whole corpus, and is prefix-stable (a larger
    ``max_bytes`` only appends).
    Files that cannot be read or are not valid UTF-8 are skipped rather than failing the run.
    """
    root = Path(stdlib_dir if stdlib_dir is not None else _default_stdlib_dir())
    train: list[bytes] = []
    val: list[bytes] = []
    total = val_total = 0
    for path in stdlib_source_files(str(root)):
        try:
            data = path.read_bytes()
            data.decode("utf-8")  # only valid UTF-8 text enters the corpus
        except (OSError, UnicodeDecodeError):
            continue
        if not data.strip():
            continue
        # The budget includes the blank-line separator; a cut never splits a UTF-8 character.
        data = (data + b"\n\n")[: max_bytes - total].decode("utf-8", "ignore").encode("utf-8")
        total += len(data)
        if val_total + len(data) <= val_fraction * total:
            val.append(data)
            val_total += len(data)
        else:
            train.append(data)
        if total >= max_bytes:
            break
    return b"".join(train), b"".join(val)


class _ByteWindows(Dataset):
    """Windows ``data[s : s + seq_len]`` (input) and ``data[s + 1 : s + seq_len + 1]`` (target)."""

    def __init__(self, data: torch.Tensor, seq_len: int, offset: int) -> None:
        self.data = data
        self.seq_len = seq_len
        self.offset = offset
        self.length = max(0, (len(data) - offset - 1) // seq_len)

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        if not 0 <= index < self.length:
            raise IndexError(f"window index {index} out of range for {self.length} windows")
        start = self.offset + index * self.seq_len
        chunk = self.data[start : start + self.seq_len + 1].long()
        return chunk[:-1], chunk[1:]


class StdlibTextData(L.LightningDataModule):
    """Next-byte prediction on the standard library's source files.

    The corpus (see :func:`load_stdlib_corpus`) is cut into non-overlapping windows of
    ``seq_len + 1`` bytes; each sample is ``(input, target)`` = (window[:-1], window[1:]) as int64
    tensors of shape ``(seq_len,)`` with values in [0, 255]. The training windows start at a
    random offset in ``[0, seq_len)`` drawn from the "train" stream of ``seed`` (so different seeds
    see differently aligned windows); validation windows always start at 0. The text is read in
    ``setup`` (identically on every rank) and nothing is sharded here: Lightning's
    ``DistributedSampler`` does that.
    """

    def __init__(
        self,
        seq_len: int = 64,
        max_bytes: int = 2_000_000,
        val_fraction: float = 0.1,
        batch_size: int = 32,
        num_workers: int = 0,
        seed: int = 0,
        stdlib_dir: str | None = None,
    ) -> None:
        super().__init__()
        for name in ("seq_len", "max_bytes", "batch_size"):
            _check_positive(name, locals()[name])
        if not 0.0 < val_fraction < 1.0:
            raise ValueError(
                f"val_fraction={val_fraction!r} must be strictly between 0 and 1: both the training "
                "and the validation set need text."
            )
        if num_workers < 0:
            raise ValueError(f"num_workers={num_workers!r} must be >= 0 (0 loads in the main process).")
        self.save_hyperparameters()
        self.train_set: _ByteWindows | None = None
        self.val_set: _ByteWindows | None = None

    def corpus(self) -> tuple[bytes, bytes]:
        """The ``(train, val)`` text as bytes; raises a ``ValueError`` if either is too short."""
        hp = self.hparams
        train, val = load_stdlib_corpus(hp.max_bytes, hp.val_fraction, hp.stdlib_dir)
        for split, data in (("training", train), ("validation", val)):
            if len(data) < 2 * (hp.seq_len + 1):
                raise ValueError(
                    f"The {split} text has only {len(data)} bytes, too few for windows of "
                    f"seq_len={hp.seq_len} (max_bytes={hp.max_bytes}, val_fraction={hp.val_fraction}). "
                    "Increase max_bytes, adjust val_fraction, or lower seq_len."
                )
        return train, val

    def setup(self, stage: str | None = None) -> None:
        if self.train_set is None:
            train, val = self.corpus()
            offset = int(torch.randint(0, self.hparams.seq_len, (1,), generator=self._generator("train")))
            self.train_set = _ByteWindows(
                torch.frombuffer(bytearray(train), dtype=torch.uint8), self.hparams.seq_len, offset
            )
            self.val_set = _ByteWindows(
                torch.frombuffer(bytearray(val), dtype=torch.uint8), self.hparams.seq_len, 0
            )

    def _generator(self, stream: str) -> torch.Generator:
        return stream_generator(self.hparams.seed, stream)

    def generate(self, split: str) -> tuple[torch.Tensor, torch.Tensor]:
        """All windows of ``split`` stacked: int64 ``(inputs, targets)`` of shape ``(n, seq_len)``."""
        if split not in ("train", "val"):
            raise ValueError(f"split={split!r} is not a split of this DataModule; use 'train' or 'val'.")
        self.setup()
        dataset = self.train_set if split == "train" else self.val_set
        pairs = [dataset[i] for i in range(len(dataset))]
        return torch.stack([p[0] for p in pairs]), torch.stack([p[1] for p in pairs])

    def train_dataloader(self) -> DataLoader:
        return train_loader(self.train_set, self.hparams.batch_size, self._generator("shuffle"), self.hparams.num_workers)

    def val_dataloader(self) -> DataLoader:
        return val_loader(self.val_set, max(self.hparams.batch_size, 64), self.hparams.num_workers)


class ByteLanguageModel(L.LightningModule):
    """What the byte-level language models share: next-byte cross-entropy, its logging and clipping.

    ``training_step`` logs ``train_loss`` (nats/byte); ``validation_step`` logs ``val_loss``
    (nats/byte) and ``val_bpb`` (bits per byte = nats / ln 2), averaged over ranks. The loss is
    taken in fp32 (in ``bf16-mixed`` the logits are bf16). ``configure_gradient_clipping`` clips the
    global L2 norm at ``hparams.grad_clip`` (0 disables) unless the Trainer sets
    ``gradient_clip_val``, which takes precedence: a module-level value travels with the model into
    Trainers that set no clipping (the benchmark's). Subclasses define ``forward`` (logits
    ``(batch, seq_len, vocab_size)``) and save ``grad_clip`` in their hyperparameters.
    """

    vocab_size = 256

    def configure_model(self) -> None:
        """Under a model-parallel strategy (FSDP2), shard each of ``self.blocks`` and then the rest of
        the model on the strategy's data-parallel mesh; under DDP (no device mesh), nothing. A strategy
        with a ``fully_shard_kwargs()`` method says what ``fully_shard`` takes (lightning_gc's
        ``GCModelParallelStrategy``: the mesh of one node's ranks); otherwise the ``data_parallel`` mesh."""
        mesh = self._device_mesh
        if mesh is None:
            return
        from torch.distributed.fsdp import fully_shard

        own = getattr(self.trainer.strategy, "fully_shard_kwargs", None)
        kwargs = own() if callable(own) else {"mesh": mesh["data_parallel"]}
        for block in getattr(self, "blocks", ()):
            fully_shard(block, **kwargs)
        fully_shard(self, **kwargs)

    def _loss(self, batch) -> torch.Tensor:
        x, y = batch
        logits = self(x)
        return F.cross_entropy(logits.reshape(-1, self.vocab_size).float(), y.reshape(-1))

    def training_step(self, batch, batch_idx: int) -> torch.Tensor:
        loss = self._loss(batch)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch, batch_idx: int) -> None:
        loss = self._loss(batch)
        self.log("val_loss", loss, on_epoch=True, sync_dist=True)
        self.log("val_bpb", loss / math.log(2), on_epoch=True, prog_bar=True, sync_dist=True)

    def configure_gradient_clipping(
        self, optimizer, gradient_clip_val=None, gradient_clip_algorithm=None
    ) -> None:
        clip = gradient_clip_val if gradient_clip_val is not None else self.hparams.grad_clip
        if clip:
            self.clip_gradients(
                optimizer, gradient_clip_val=clip, gradient_clip_algorithm=gradient_clip_algorithm or "norm"
            )


class ByteLM(ByteLanguageModel):
    """Byte-level LSTM language model: 256-symbol embedding -> ``num_layers`` LSTM -> 256-way softmax.

    Every window is processed from a zero state (no state is carried between batches, because the
    shuffled, sharded windows are not consecutive). Logs ``train_loss`` (nats/byte) every step and
    ``val_loss`` (nats/byte) and ``val_bpb`` (bits per byte = nats / ln 2) every validation epoch;
    a model that has learned nothing scores 8 bits per byte, a unigram (byte-frequency) model about
    4.5 on this text.

    ``grad_clip`` (global L2 norm, 0 disables) is applied through ``configure_gradient_clipping``
    so the model is stable with plain SGD even when the Trainer sets no clipping; a Trainer
    ``gradient_clip_val`` takes precedence.
    """

    def __init__(
        self,
        embed_dim: int = 64,
        hidden_size: int = 256,
        num_layers: int = 1,
        dropout: float = 0.0,
        lr: float = 1.0,
        momentum: float = 0.9,
        weight_decay: float = 0.0,
        optimizer: str = "sgd",
        grad_clip: float = 1.0,
    ) -> None:
        super().__init__()
        for name in ("embed_dim", "hidden_size", "num_layers"):
            _check_positive(name, locals()[name])
        if not 0.0 <= dropout < 1.0:
            raise ValueError(f"dropout={dropout!r} must be in [0, 1).")
        if grad_clip < 0:
            raise ValueError(f"grad_clip={grad_clip!r} must be >= 0 (0 disables clipping).")
        validate_optimizer_args(optimizer, lr, momentum, weight_decay)
        self.save_hyperparameters()
        self.embedding = nn.Embedding(self.vocab_size, embed_dim)
        self.lstm = nn.LSTM(
            embed_dim,
            hidden_size,
            num_layers=num_layers,
            batch_first=True,
            dropout=dropout if num_layers > 1 else 0.0,
        )
        self.head = nn.Linear(hidden_size, self.vocab_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Logits ``(batch, seq_len, 256)`` for int64 byte inputs ``(batch, seq_len)``."""
        out, _ = self.lstm(self.embedding(x))
        return self.head(out)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        hp = self.hparams
        return build_optimizer(self.parameters(), hp.optimizer, hp.lr, hp.momentum, hp.weight_decay)
