"""docs/multi-node.md's worked example: two "nodes" (two torchrun invocations, --nnodes=2, one
process each) on loopback, shortened to a few steps. Oracle: the step counts by hand (6 optimizer
steps, 1 dense warm-up step) and the world size/rank layout torchrun was told to build."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from dist_harness import free_port

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[1]
STEPS = 6


def test_two_torchrun_nodes_on_loopback_train_one_job(tmp_path):
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "TORCHELASTIC_"))}
    env.update(PYTHONWARNINGS="ignore", GLOO_SOCKET_IFNAME="lo")  # the interface choice the page describes
    procs = []
    for node in (0, 1):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc-per-node=1",
               f"--node-rank={node}", "--master-addr=127.0.0.1", f"--master-port={port}",
               "-m", "lightning_gc.cli", "fit", "--config", str(REPO / "recipes" / "quickstart.yaml"),
               "--trainer.num_nodes=2", "--trainer.devices=1", f"--trainer.max_steps={STEPS}",
               "--trainer.limit_val_batches=2", "--trainer.logger=false", "--trainer.enable_checkpointing=false",
               "--trainer.enable_progress_bar=false"]
        procs.append(subprocess.Popen(cmd, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                      text=True))
    outs = []
    for p in procs:
        try:
            out, err = p.communicate(timeout=300)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise
        outs.append((p.returncode, out + err))
    for node, (rc, text) in enumerate(outs):
        assert rc == 0, text[-3000:]
        assert f"GLOBAL_RANK: {node}, MEMBER: {node + 1}/2" in text  # one process per node, world size 2
    node0, node1 = outs[0][1], outs[1][1]
    assert "lightning_gc summary (rank 0 of 2): compressor=topk collective=allgather" in node0
    assert f"optimizer steps: {STEPS} ({STEPS - 1} compressed, 1 dense)" in node0
    assert "lightning_gc summary" not in node1  # printed by global rank zero only
