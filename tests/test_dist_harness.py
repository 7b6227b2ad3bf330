"""The multi-process harness itself (tests/dist_harness.py): ranks started from the preloading
forkserver must see what a spawned rank would see — the test's environment and working directory
at the moment of the call, not the server's from when it started — and a failing rank must fail
the test."""

from __future__ import annotations

import os

import pytest
from dist_harness import run_distributed


def _report(rank: int, world_size: int) -> dict:
    import torch.distributed as dist

    return {"env": os.environ.get("GC_HARNESS_PROBE"), "cwd": os.getcwd(), "pid": os.getpid(),
            "world": dist.get_world_size(), "rank": dist.get_rank()}


def _fail_on_rank_one(rank: int, world_size: int) -> None:
    if rank == 1:
        raise RuntimeError("rank one broke on purpose")


def test_ranks_see_the_callers_environment_and_directory_of_the_moment(tmp_path, monkeypatch):
    for value in ("first", "second"):  # the server started before this value existed
        monkeypatch.setenv("GC_HARNESS_PROBE", value)
        sub = tmp_path / value
        sub.mkdir()
        monkeypatch.chdir(sub)
        out = run_distributed(_report, 2)
        assert [o["env"] for o in out] == [value, value]
        assert [o["cwd"] for o in out] == [str(sub), str(sub)]
        assert [(o["rank"], o["world"]) for o in out] == [(0, 2), (1, 2)]
        assert len({o["pid"] for o in out} | {os.getpid()}) == 3  # separate processes
    monkeypatch.delenv("GC_HARNESS_PROBE")
    assert [o["env"] for o in run_distributed(_report, 2)] == [None, None]


def test_a_failing_rank_fails_the_call_with_its_traceback():
    with pytest.raises(AssertionError, match="rank 1 failed:(.|\n)*rank one broke on purpose"):
        run_distributed(_fail_on_rank_one, 2)
