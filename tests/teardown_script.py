"""One rank of a 2-process Lightning run, launched by tests/test_teardown.py (not a test itself).

Usage: ``python teardown_script.py MODE OUT_DIR`` with the usual MASTER_ADDR / MASTER_PORT /
LOCAL_RANK / NODE_RANK / WORLD_SIZE environment (Lightning then does not launch processes itself).
MODE ``fit`` trains to the end; MODE ``raise`` raises on rank 1 in the middle of a compressed
step's backward (after some buckets were handed to the engine), on the Lightning main thread.
"""

from __future__ import annotations

import os
import sys

import lightning as L
import torch

sys.path.insert(0, os.path.dirname(__file__))
from lit_models import TinyClassifier, make_loader  # noqa: E402

from lightning_gc import GCStrategy  # noqa: E402

RAISE_AT_STEP = 3


class Raising(TinyClassifier):
    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        if self.global_rank == 1 and self.global_step == RAISE_AT_STEP:
            def boom(grad):  # the first layer's gradient is produced last in backward
                raise ValueError(f"deliberate failure on rank 1 at step {RAISE_AT_STEP}")

            self.net[0].weight.register_hook(boom)
        return loss


def main() -> None:
    mode, out = sys.argv[1], sys.argv[2]
    torch.set_num_threads(1)
    model = Raising() if mode == "raise" else TinyClassifier()
    trainer = L.Trainer(
        strategy=GCStrategy(compressor="qsgd", plan="layer", min_compress_numel=64, warmup_steps=1),
        accelerator="cpu", devices=2, max_epochs=1, logger=False, enable_progress_bar=False,
        enable_model_summary=False, enable_checkpointing=False, default_root_dir=out,
    )
    trainer.fit(model, make_loader())
    print(f"FIT_DONE rank={trainer.global_rank} steps={trainer.global_step}", flush=True)


if __name__ == "__main__":
    main()
