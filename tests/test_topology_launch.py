"""``topology="nodes"`` as docs/topology.md launches it: two torchrun "nodes" of two processes each
on loopback, ``Trainer(num_nodes=2, devices=2)``, no ``topology_ranks_per_node`` (the ranks per node
come from Lightning's processes per node). Oracles: the layout torchrun was told to build (2 nodes x
2), the step counts by hand, and the summary's inter-node line (the counter is only non-zero when the
exchanges went by nodes)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from dist_harness import free_port

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[1]
STEPS = 4


def test_torchrun_two_nodes_of_two_go_by_nodes(tmp_path):
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "TORCHELASTIC_"))}
    env.update(PYTHONWARNINGS="ignore", GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1")
    procs = []
    for node in (0, 1):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc-per-node=2",
               f"--node-rank={node}", "--master-addr=127.0.0.1", f"--master-port={port}",
               "-m", "lightning_gc.cli", "fit", "--config", str(REPO / "recipes" / "quickstart.yaml"),
               "--trainer.strategy.init_args.topology=nodes",
               "--trainer.num_nodes=2", "--trainer.devices=2", f"--trainer.max_steps={STEPS}",
               "--trainer.limit_val_batches=1", "--trainer.logger=false", "--trainer.enable_checkpointing=false",
               "--trainer.enable_progress_bar=false"]
        procs.append(subprocess.Popen(cmd, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                      text=True))
    outs = []
    for p in procs:
        try:
            out, err = p.communicate(timeout=400)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise
        outs.append((p.returncode, out + err))
    for rc, text in outs:
        assert rc == 0, text[-3000:]
    node0 = outs[0][1]
    assert "topology=nodes intra_dtype=fp32" in node0  # the startup header
    assert "lightning_gc summary (rank 0 of 4): compressor=topk collective=allgather" in node0
    assert f"optimizer steps: {STEPS} ({STEPS - 1} compressed, 1 dense)" in node0
    assert "between nodes:" in node0 and "topology=nodes" in node0
