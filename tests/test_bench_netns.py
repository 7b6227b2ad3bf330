"""The emulated cluster: namespaces, shaping, counters and cleanup.

Everything that needs network namespaces is skipped where they cannot be created (not root, no
iproute2, no namespace support). All addresses used live inside the namespaces these tests create.
"""

from __future__ import annotations

import os
import re
import signal
import statistics
import subprocess
import sys
import time

import pytest

from lightning_gc.bench import netns
from lightning_gc.bench.runner import BenchConfig, run_bench

_OK, _WHY = netns.namespaces_available()
needs_netns = pytest.mark.skipif(not _OK, reason=f"network namespaces unavailable: {_WHY}")

_SERVER = """
import socket, sys
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind((sys.argv[1], 5999)); s.listen(1); print("ready", flush=True)
c, _ = s.accept(); n = 0
while True:
    d = c.recv(65536)
    if not d: break
    n += len(d)
c.sendall(str(n).encode()); c.close()
"""
_CLIENT = """
import socket, sys
c = socket.create_connection((sys.argv[1], 5999), timeout=20)
c.sendall(b"x" * int(sys.argv[2])); c.shutdown(socket.SHUT_WR); print(c.recv(64).decode())
"""


def _transfer(cluster: netns.EmulatedCluster, nbytes: int) -> int:
    """Send ``nbytes`` from host 0 to host 1 over the emulated link; returns what host 1 received."""
    server = subprocess.Popen(cluster.exec_prefix(1) + [sys.executable, "-c", _SERVER, cluster.host_ip(1)],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert server.stdout.readline().strip() == "ready"
        out = subprocess.run(cluster.exec_prefix(0) + [sys.executable, "-c", _CLIENT, cluster.host_ip(1), str(nbytes)],
                             capture_output=True, text=True, timeout=60, check=True)
        return int(out.stdout.strip())
    finally:
        server.kill()
        server.wait()


def _prefix_from(lines: list[str]) -> str:
    for line in lines:
        m = re.search(r"(lgcb-\d+-[0-9a-f]{4})", line)
        if m:
            return m.group(1)
    raise AssertionError("no namespace prefix in the log:\n" + "\n".join(lines))


def _assert_no_leftovers(prefix: str | None, marker: str) -> None:
    if prefix is not None:
        left = [n for n in netns.list_own_namespaces() if n.startswith(prefix + "-")]
        assert left == [], f"namespaces left behind: {left}"
    procs = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as fh:
                cmd = fh.read().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if marker in cmd and "lightning_gc.bench.worker" in cmd:
            procs.append((pid, cmd))
    assert procs == [], f"worker processes left behind: {procs}"


@needs_netns
@pytest.mark.netns
def test_two_clusters_at_once_with_identical_addresses_do_not_collide():
    a = netns.EmulatedCluster(hosts=2, subnet=77, shaper="tbf")
    b = netns.EmulatedCluster(hosts=2, subnet=77, shaper="htb")
    with a, b:
        assert a.prefix != b.prefix
        assert a.host_ip(1) == b.host_ip(1)  # same addresses, separate L2 segments
        assert set(a.namespaces).isdisjoint(b.namespaces)
        a.set_rate(200_000_000)
        b.set_rate(100_000_000)
        b.set_rate(300_000_000)  # change in place
        tx_a, tx_b = a.tx_bytes(0), b.tx_bytes(0)
        assert _transfer(a, 300_000) == 300_000
        assert _transfer(b, 100_000) == 100_000
        # each transfer is counted by its own cluster's interface only (payload + headers)
        assert a.tx_bytes(0) - tx_a >= 300_000
        assert 100_000 <= b.tx_bytes(0) - tx_b < 300_000
        assert "htb" in b.qdisc_stats(0) and "tbf" in a.qdisc_stats(0)
        names = set(a.namespaces) | set(b.namespaces)
    assert names.isdisjoint(netns.list_own_namespaces())


@needs_netns
@pytest.mark.netns
def test_cluster_creation_failure_removes_what_was_created(monkeypatch):
    cluster = netns.EmulatedCluster(hosts=3)
    real_run = netns._run

    def failing(cmd, **kw):
        if cmd[:3] == ["ip", "netns", "add"] and cmd[3].endswith("-h2"):
            raise netns.NetnsError("simulated failure creating host 2")
        return real_run(cmd, **kw)

    monkeypatch.setattr(netns, "_run", failing)
    with pytest.raises(netns.NetnsError, match="simulated"):
        cluster.create()
    monkeypatch.setattr(netns, "_run", real_run)
    assert [n for n in netns.list_own_namespaces() if n.startswith(cluster.prefix)] == []


@needs_netns
@pytest.mark.netns
@pytest.mark.slow
def test_shaped_dense_run_respects_the_link_rate(tmp_path):
    rate = 10_000_000  # 10 Mbit/s; probe width 256 -> 263 kB of fp32 gradient per step
    lines: list[str] = []
    doc = run_bench(
        BenchConfig(preset="probe", preset_args={"width": 256}, ranks=2, hosts=2, bandwidth="10mbit", methods="ddp",
                    steps=8, warmup=2, compute_steps=2, eval_every=8, val_batches=1, network="netns", threads=1,
                    timeout_s=300, logs_dir=str(tmp_path)),
        log=lines.append,
    )
    assert doc["emulated"] is True and doc["network"]["mode"] == "netns" and doc["network"]["shaped"]
    (res,) = doc["results"]
    assert res["status"] == "ok", res["error"]
    dense_bytes = 4 * (256 * 256 + 256)
    burst = netns.tc_burst_bytes(rate)
    assert len(res["wire_counters"]) == 2
    for c in res["wire_counters"]:
        # physical upper bound of a token bucket: rate * time + bucket depth (+ one GSO super-packet)
        assert c["tx_bytes"] <= rate / 8 * c["seconds"] * 1.01 + burst + 65536, c
        # information lower bound for 2 hosts: each host must send its whole fp32 gradient every step,
        # less what may still wait in its own shaped egress queue when the window closes (a send
        # completes once the socket accepts it; the interface counts a byte when tbf releases it):
        # at most the step's last message, the allgather half of the gradient
        assert c["tx_bytes"] >= dense_bytes * res["measured_steps"] - dense_bytes // 2, c
    assert res["link_utilization"] <= 1.01 + (burst + 65536) * 8 / (rate * sum(res["step_times_s"][2:]))
    # per step, the same lower bound: the last message may still wait in the egress queue when the window
    # closes (seen once on CI: 261 229 wire bytes per step against the 263 168 of the byte model, 0.7 % short)
    assert res["bytes_per_step"] == pytest.approx(dense_bytes)
    assert res["wire_bytes_per_step"] >= dense_bytes - dense_bytes // 2 / res["measured_steps"]
    _assert_no_leftovers(_prefix_from(lines), str(tmp_path))


@needs_netns
@pytest.mark.netns
@pytest.mark.slow
def test_rate_change_within_a_step_lands_after_the_step_began_and_slows_the_rest(tmp_path):
    """--change-in-step: rank 0 asks for the change half a step into the boundary step and does not wait;
    the runner's time of applying it comes back as an offset into that step, and the link is slow after."""
    lines: list[str] = []
    doc = run_bench(
        BenchConfig(preset="probe", preset_args={"width": 256}, ranks=2, hosts=2, schedule="0:100mbit,0.5:2mbit",
                    change_in_step=0.5, methods="ddp", steps=10, warmup=2, compute_steps=2, eval_every=10,
                    val_batches=1, network="netns", threads=1, timeout_s=300, logs_dir=str(tmp_path)),
        log=lines.append,
    )
    (res,) = doc["results"]
    assert res["status"] == "ok", res["error"]
    (change,) = res["rate_changes"]
    assert change["step"] == 5 and change["rate_bps"] == 2_000_000
    # half the median of rank 0's walls before it; the walls in the result are the slowest rank's, so not equal
    before = res["step_times_s"][:5]
    assert 0 < change["requested_offset_s"] <= 0.5 * max(before) + 1e-6, change
    assert change["applied_offset_s"] >= change["requested_offset_s"], change
    # 263 kB of gradient per step at 2 Mbit/s: over 0.5 s a step after the change, against a fast step before it
    assert min(res["step_times_s"][6:]) > 5 * statistics.median(before), res["step_times_s"]
    assert any("link rate -> 2mbit" in line for line in lines), lines
    _assert_no_leftovers(_prefix_from(lines), str(tmp_path))


@needs_netns
@pytest.mark.netns
@pytest.mark.slow
def test_failing_rank_stops_the_others_and_removes_the_namespaces(tmp_path):
    lines: list[str] = []
    doc = run_bench(
        BenchConfig(preset="probe", preset_args={"width": 64}, ranks=2, hosts=2, bandwidth="100mbit", methods="ddp",
                    steps=6, warmup=2, network="netns", threads=1, timeout_s=300, logs_dir=str(tmp_path),
                    fail_rank=1, fail_step=3),
        log=lines.append,
    )
    (res,) = doc["results"]
    assert res["status"] == "error"
    assert "rank 1 exited with code 1" in res["error"] and "injected failure on rank 1 at step 3" in res["error"]
    assert res["step_time_s"] is None and res["ratio_vs_ddp"] is None
    assert any("FAILED" in line for line in lines)
    _assert_no_leftovers(_prefix_from(lines), str(tmp_path))


@pytest.mark.slow
def test_failing_rank_on_loopback_stops_the_others(tmp_path):
    lines: list[str] = []
    doc = run_bench(
        BenchConfig(preset="probe", preset_args={"width": 64}, ranks=2, methods="ddp", steps=6, warmup=2,
                    network="loopback", threads=1, timeout_s=300, logs_dir=str(tmp_path), fail_rank=0, fail_step=2),
        log=lines.append,
    )
    assert doc["emulated"] is False
    assert any("LOOPBACK - NOT emulated" in line for line in lines)
    (res,) = doc["results"]
    assert res["status"] == "error" and "injected failure on rank 0 at step 2" in res["error"]
    _assert_no_leftovers(None, str(tmp_path))


@needs_netns
@pytest.mark.netns
@pytest.mark.slow
def test_ctrl_c_removes_namespaces_and_workers(tmp_path):
    out = tmp_path / "stdout.txt"
    cmd = [sys.executable, "-m", "lightning_gc.bench", "--preset", "probe", "--preset-arg", "width=64", "--ranks", "2",
           "--methods", "ddp", "--steps", "100000", "--bandwidth", "100mbit", "--network", "netns", "--threads", "1",
           "--logs", str(tmp_path / "logs")]
    with open(out, "w") as fh:
        # SIGINT at its default in the bench whatever this process inherited: SIG_IGN survives exec,
        # and pytest started as a background job of a non-interactive shell (`bash .ci/run &`) has
        # SIGINT ignored, so the bench would rightly ignore the test's Ctrl-C (it failed that way).
        proc = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT,
                                preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        deadline = time.monotonic() + 240
        while "[ddp] step" not in out.read_text():  # training is running on both ranks
            assert proc.poll() is None, out.read_text()
            assert time.monotonic() < deadline, out.read_text()
            time.sleep(0.2)
        proc.send_signal(signal.SIGINT)
        try:
            rc = proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            pytest.fail(f"the bench did not exit within 60 s of SIGINT; its output so far:\n{out.read_text()[-4000:]}")
    finally:
        if proc.poll() is None:  # SIGTERM first: the bench turns it into cleanup of its namespaces
            proc.terminate()
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
    text = out.read_text()
    assert rc == 130, text
    assert "interrupted" in text and "removed namespaces" in text
    _assert_no_leftovers(_prefix_from(text.splitlines()), str(tmp_path))


def test_root_cause_prefers_the_rank_that_raised_over_one_aborted_by_its_peer():
    """A bystander killed by a signal must not be blamed even when it is seen exiting first."""
    from lightning_gc.bench.runner import _root_cause

    aborted = subprocess.Popen([sys.executable, "-c", "import os, signal; os.kill(os.getpid(), signal.SIGABRT)"])
    aborted.wait()
    raised = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(0.5); raise SystemExit(1)"])
    assert _root_cause([aborted, raised]) == (1, 1)
    # Only signals: the first seen is reported.
    assert _root_cause([aborted]) == (0, -signal.SIGABRT)


def test_root_cause_prefers_the_rank_that_raised_over_one_that_lost_its_peer():
    """A rank whose collective broke because its peer died exits PEER_LOST_EXIT and is not blamed."""
    from lightning_gc.bench.runner import _root_cause
    from lightning_gc.bench.worker import PEER_LOST_EXIT

    lost = subprocess.Popen([sys.executable, "-c", f"raise SystemExit({PEER_LOST_EXIT})"])
    lost.wait()
    raised = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(0.5); raise SystemExit(1)"])
    assert _root_cause([lost, raised]) == (1, 1)
    assert _root_cause([lost]) == (0, PEER_LOST_EXIT)


def test_worker_classifies_a_broken_collective_as_peer_loss():
    """torch's distributed error types, and gloo's transport errors that reach Python as RuntimeError."""
    import torch.distributed as dist

    from lightning_gc.bench.worker import _is_peer_loss

    assert _is_peer_loss(dist.DistBackendError("Connection closed by peer"))
    gloo = ("[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by peer "
            "[10.0.0.2]:50879. This is typically caused by a remote worker crashing.")
    assert _is_peer_loss(RuntimeError(gloo))
    assert not _is_peer_loss(ValueError(gloo))
    assert not _is_peer_loss(RuntimeError("injected failure on rank 1 at step 3"))
    assert not _is_peer_loss(ValueError("bad preset argument"))
