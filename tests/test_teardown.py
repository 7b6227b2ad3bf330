"""Orderly teardown: every process ends with a clean exit or a Python exception, never a C++ abort.

Two real processes (launched like torchrun would, so each one's exit status and stderr can be
read) train with GCStrategy (QSGD, layer plan: the engine's worker thread and its own process group
are busy every step):

* ``fit``: training ends; both processes exit 0 after ``fit`` returns.
* ``raise``: rank 1 raises in the middle of a compressed step's backward. Rank 1 must end with its
  Python exception; rank 0, whose worker is waiting in that step's collectives, must end with a
  Python exception too (the peer is gone) — not hang, not abort with a signal.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from dist_harness import free_port

pytestmark = pytest.mark.slow
HERE = Path(__file__).resolve().parent
ABORT_MARKERS = ("terminate called", "Aborted", "core dumped", "Fatal Python error")


def _launch(mode: str, tmp: Path, timeout: float = 420.0) -> list[tuple[int, str, str]]:
    port = free_port()
    procs = []
    for rank in range(2):
        env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), LOCAL_RANK=str(rank),
                   NODE_RANK="0", WORLD_SIZE="2", PYTHONUNBUFFERED="1")
        procs.append(subprocess.Popen([sys.executable, str(HERE / "teardown_script.py"), mode, str(tmp)],
                                      env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    out = []
    try:
        for p in procs:
            stdout, stderr = p.communicate(timeout=timeout)
            out.append((p.returncode, stdout, stderr))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    return out


def _no_abort(rc: int, stderr: str) -> None:
    assert rc >= 0, f"killed by signal {-rc}:\n{stderr[-3000:]}"
    assert rc != 134, stderr[-3000:]
    for marker in ABORT_MARKERS:
        assert marker not in stderr, f"{marker!r} in stderr:\n{stderr[-3000:]}"


def test_fit_ends_with_a_clean_exit_on_every_rank(tmp_path):
    for rank, (rc, stdout, stderr) in enumerate(_launch("fit", tmp_path)):
        _no_abort(rc, stderr)
        assert rc == 0, f"rank {rank} exit {rc}:\n{stderr[-3000:]}"
        assert f"FIT_DONE rank={rank}" in stdout


def test_exception_mid_step_ends_every_rank_with_a_python_exception(tmp_path):
    results = _launch("raise", tmp_path)
    for rank, (rc, stdout, stderr) in enumerate(results):
        _no_abort(rc, stderr)
        assert rc != 0, f"rank {rank} exited 0 although rank 1 failed:\n{stdout}"
        assert "Traceback (most recent call last)" in stderr, stderr[-3000:]
    assert "deliberate failure on rank 1" in results[1][2]
