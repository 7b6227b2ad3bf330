"""Emulated cluster: one network namespace per host, joined through a bridge, with shaped links.

Topology for a run with prefix ``P`` (unique per run: ``lgcb-<pid>-<4 hex>``) and ``H`` hosts::

    netns P-h0  [gc0 10.213.S.1/24] --veth-- [p0 ┐
    netns P-h1  [gc0 10.213.S.2/24] --veth-- [p1 ├ br0]  netns P-sw  (the "switch")
    ...                                       ...┘

Every interface lives inside one of the run's own namespaces (the veth pairs are created directly
there), so nothing is added to the root namespace, interface names can be fixed short names, and two
runs at once cannot collide: their namespaces have different names and their links are different
L2 segments with no route between them or to the outside. ``S`` (the /24) is drawn at random anyway,
to keep addresses in logs distinguishable.

Shaping: each host's egress (``gc0`` in the host namespace) gets a ``tc`` ``htb`` (default) or
``tbf`` qdisc at the link rate; with ``shape_ingress`` (default) the switch port towards the host
(``pN`` in the switch namespace) is shaped the same way, so the rate holds in both directions like a
full-duplex NIC and fan-in to one host cannot exceed it either. Rates change in place
(``tc qdisc change`` / ``tc class change``) while training runs. There is no latency emulation
(``netem`` is not available), only rate limiting.

Counters: the host interface's transmit counter (headers included), read by
:meth:`EmulatedCluster.tx_bytes` from outside and by :func:`read_tx_bytes` in the workers.

Cleanup: every cluster registers itself in a process-wide registry; the registry runs on normal exit
(``atexit``), on ``SIGTERM``/``SIGHUP`` (converted to ``SystemExit`` so ``finally`` blocks run too)
and, through ``KeyboardInterrupt``, on Ctrl-C. Deleting a namespace deletes the interfaces, the
bridge and the qdiscs in it. Namespaces left behind by a run that was killed with ``SIGKILL`` can
be removed with :func:`sweep_stale` (``lightning-gc bench --cleanup-stale``).
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import re
import secrets
import shutil
import signal
import subprocess
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

__all__ = [
    "NetnsError",
    "IFNAME",
    "EmulatedCluster",
    "namespaces_available",
    "register_cleanup",
    "unregister_cleanup",
    "run_cleanups",
    "install_signal_handlers",
    "list_own_namespaces",
    "sweep_stale",
    "tc_burst_bytes",
]

IFNAME = "gc0"  # the host-side interface name inside every host namespace
NS_PREFIX = "lgcb"
_NS_RE = re.compile(rf"^{NS_PREFIX}-(\d+)-([0-9a-f]{{4}})-(sw|h\d+|probe)$")


class NetnsError(RuntimeError):
    """Creating or driving the emulated network failed; the message says which command and why."""


# --------------------------------------------------------------------------- cleanup registry

_cleanups: dict[int, Callable[[], None]] = {}
_cleanup_lock = threading.Lock()
_next_id = [0]
_atexit_installed = [False]


def register_cleanup(fn: Callable[[], None]) -> int:
    """Register ``fn`` to run at exit / on termination signals; returns a handle for :func:`unregister_cleanup`."""
    with _cleanup_lock:
        _next_id[0] += 1
        handle = _next_id[0]
        _cleanups[handle] = fn
        if not _atexit_installed[0]:
            atexit.register(run_cleanups)
            _atexit_installed[0] = True
    return handle


def unregister_cleanup(handle: int) -> None:
    with _cleanup_lock:
        _cleanups.pop(handle, None)


def run_cleanups() -> None:
    """Run every registered cleanup, newest first; errors are reported but do not stop the others."""
    while True:
        with _cleanup_lock:
            if not _cleanups:
                return
            handle = max(_cleanups)
            fn = _cleanups.pop(handle)
        try:
            fn()
        except Exception as exc:  # noqa: BLE001 - best effort, keep cleaning
            print(f"[lightning-gc bench] cleanup step failed: {exc}", flush=True)


def install_signal_handlers() -> Callable[[], None]:
    """Turn SIGTERM/SIGHUP into ``SystemExit`` (so ``finally`` blocks and cleanups run).

    Returns a function restoring the previous handlers. A no-op outside the main thread.
    """
    if threading.current_thread() is not threading.main_thread():
        return lambda: None
    previous = {}

    def handler(signum, _frame):
        raise SystemExit(128 + signum)

    for sig in (signal.SIGTERM, signal.SIGHUP):
        with contextlib.suppress(ValueError, OSError):
            previous[sig] = signal.signal(sig, handler)

    def restore() -> None:
        for sig, old in previous.items():
            with contextlib.suppress(ValueError, OSError):
                signal.signal(sig, old)

    return restore


# --------------------------------------------------------------------------- helpers


def _run(cmd: list[str], *, check: bool = True, timeout: float = 30.0) -> subprocess.CompletedProcess:
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except FileNotFoundError as exc:
        raise NetnsError(f"command {cmd[0]!r} not found ({exc}); install iproute2 or run with --network loopback") from exc
    except subprocess.TimeoutExpired as exc:
        raise NetnsError(f"command {' '.join(cmd)!r} did not finish within {timeout:.0f}s") from exc
    if check and proc.returncode != 0:
        raise NetnsError(
            f"command {' '.join(cmd)!r} failed with exit code {proc.returncode}: "
            f"{(proc.stderr or proc.stdout).strip() or 'no output'}"
        )
    return proc


def tc_burst_bytes(rate_bps: int) -> int:
    """Token-bucket depth: 2 ms at the rate, at least 64 KiB (one GSO super-packet must fit)."""
    return max(64 * 1024, int(rate_bps / 8 * 0.002))


def _new_prefix() -> str:
    return f"{NS_PREFIX}-{os.getpid()}-{secrets.token_hex(2)}"


def list_own_namespaces() -> list[str]:
    """Names of every namespace that looks like one of this tool's (any run, any process)."""
    if not shutil.which("ip"):
        return []
    proc = _run(["ip", "netns", "list"], check=False)
    names = [line.split()[0] for line in proc.stdout.splitlines() if line.strip()]
    return [n for n in names if _NS_RE.match(n)]


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # it exists, owned by another user
        pass
    return True


def sweep_stale(log: Callable[[str], None] = print) -> list[str]:
    """Delete this tool's namespaces whose creating process no longer exists. Returns the names removed.

    Only call this on a machine where all runs share one PID namespace: a run in another PID namespace
    looks dead from here.
    """
    removed = []
    for name in list_own_namespaces():
        m = _NS_RE.match(name)
        assert m
        if _pid_alive(int(m.group(1))):
            continue
        if _run(["ip", "netns", "pids", name], check=False).stdout.split():
            log(f"kept namespace {name}: its creator is gone but processes still run in it")
            continue
        proc = _run(["ip", "netns", "delete", name], check=False)
        if proc.returncode == 0:
            removed.append(name)
            log(f"removed stale namespace {name}")
        else:
            log(f"could not remove stale namespace {name}: {proc.stderr.strip()}")
    return removed


def _kill_pids_in_ns(name: str) -> None:
    proc = _run(["ip", "netns", "pids", name], check=False)
    for tok in proc.stdout.split():
        with contextlib.suppress(ValueError, ProcessLookupError, PermissionError):
            os.kill(int(tok), signal.SIGKILL)


def namespaces_available() -> tuple[bool, str]:
    """Can this process build an emulated cluster? Returns ``(ok, reason)``; creates and removes a probe namespace."""
    if os.name != "posix" or not os.path.isdir("/proc/self/ns"):
        return False, "not a Linux system with network namespaces"
    if os.geteuid() != 0:
        return False, "not running as root (network namespaces and tc need CAP_NET_ADMIN / CAP_SYS_ADMIN)"
    for tool in ("ip", "tc"):
        if not shutil.which(tool):
            return False, f"the {tool!r} command (iproute2) is not installed"
    probe = f"{_new_prefix()}-probe"
    proc = _run(["ip", "netns", "add", probe], check=False)
    if proc.returncode != 0:
        return False, f"'ip netns add' failed: {(proc.stderr or proc.stdout).strip()}"
    steps = (
        ("create a bridge in a namespace", ["ip", "-n", probe, "link", "add", "br0", "type", "bridge"]),
        ("create a veth pair in a namespace",
         ["ip", "link", "add", "v0", "netns", probe, "type", "veth", "peer", "name", "v1", "netns", probe]),
        ("attach a tc tbf qdisc",
         ["tc", "-n", probe, "qdisc", "add", "dev", "v0", "root", "tbf", "rate", "1mbit", "burst", "64kb", "latency",
          "50ms"]),
    )
    try:
        for what, cmd in steps:
            r = _run(cmd, check=False)
            if r.returncode != 0:
                return False, f"cannot {what}: {(r.stderr or r.stdout).strip()}"
    finally:
        _run(["ip", "netns", "delete", probe], check=False)
    return True, "root, iproute2 and network namespaces available"


# --------------------------------------------------------------------------- the cluster


@dataclass
class EmulatedCluster:
    """``hosts`` namespaces on one bridge; see the module docstring. Use as a context manager."""

    hosts: int
    shaper: str = "htb"
    shape_ingress: bool = True
    prefix: str = field(default_factory=_new_prefix)
    subnet: int = field(default_factory=lambda: 1 + secrets.randbelow(254))
    log: Callable[[str], None] = print
    rate_bps: int | None = None
    _created: list[str] = field(default_factory=list)
    _cleanup_handle: int | None = None

    def __post_init__(self) -> None:
        if self.hosts < 1 or self.hosts > 250:
            raise NetnsError(f"hosts={self.hosts}: an emulated cluster needs 1..250 hosts; pass a value in that range")
        if self.shaper not in ("tbf", "htb"):
            raise NetnsError(f"shaper={self.shaper!r} is not supported: use 'tbf' or 'htb'")

    # names -----------------------------------------------------------------
    @property
    def switch_ns(self) -> str:
        return f"{self.prefix}-sw"

    def host_ns(self, h: int) -> str:
        return f"{self.prefix}-h{h}"

    def host_ip(self, h: int) -> str:
        return f"10.213.{self.subnet}.{h + 1}"

    def exec_prefix(self, h: int) -> list[str]:
        return ["ip", "netns", "exec", self.host_ns(h)]

    @property
    def namespaces(self) -> list[str]:
        return list(self._created)

    # lifecycle -------------------------------------------------------------
    def __enter__(self) -> EmulatedCluster:
        self.create()
        return self

    def __exit__(self, *exc) -> None:
        self.destroy()

    def _add_ns(self, name: str) -> None:
        _run(["ip", "netns", "add", name])
        self._created.append(name)

    def create(self) -> None:
        self._cleanup_handle = register_cleanup(self.destroy)
        try:
            sw = self.switch_ns
            self._add_ns(sw)
            _run(["ip", "-n", sw, "link", "add", "br0", "type", "bridge"])
            _run(["ip", "-n", sw, "link", "set", "br0", "up"])
            _run(["ip", "-n", sw, "link", "set", "lo", "up"])
            for h in range(self.hosts):
                ns = self.host_ns(h)
                self._add_ns(ns)
                port = f"p{h}"
                _run(["ip", "link", "add", IFNAME, "netns", ns, "type", "veth", "peer", "name", port, "netns", sw])
                _run(["ip", "-n", sw, "link", "set", port, "master", "br0"])
                _run(["ip", "-n", sw, "link", "set", port, "up"])
                _run(["ip", "-n", ns, "addr", "add", f"{self.host_ip(h)}/24", "dev", IFNAME])
                _run(["ip", "-n", ns, "link", "set", IFNAME, "up"])
                _run(["ip", "-n", ns, "link", "set", "lo", "up"])
        except BaseException:
            self.destroy()
            raise

    def destroy(self) -> None:
        """Kill anything still running in the namespaces, then delete them. Idempotent."""
        if self._cleanup_handle is not None:
            unregister_cleanup(self._cleanup_handle)
            self._cleanup_handle = None
        errors = []
        for name in reversed(self._created):
            _kill_pids_in_ns(name)
            proc = _run(["ip", "netns", "delete", name], check=False)
            if proc.returncode != 0 and "No such file" not in proc.stderr:
                errors.append(f"{name}: {proc.stderr.strip()}")
        self._created.clear()
        if errors:
            raise NetnsError("could not delete namespaces " + "; ".join(errors) + "; remove them with 'ip netns delete'")

    # shaping ---------------------------------------------------------------
    def _links(self) -> list[tuple[str, str]]:
        links = [(self.host_ns(h), IFNAME) for h in range(self.hosts)]
        if self.shape_ingress:
            links += [(self.switch_ns, f"p{h}") for h in range(self.hosts)]
        return links

    def set_rate(self, rate_bps: int | None) -> None:
        """Shape every link to ``rate_bps`` (``None`` removes shaping). Changes in place while traffic flows."""
        for ns, dev in self._links():
            self._shape(ns, dev, rate_bps)
        self.rate_bps = rate_bps

    def _shape(self, ns: str, dev: str, rate_bps: int | None) -> None:
        tc = ["tc", "-n", ns]
        if rate_bps is None:
            _run(tc + ["qdisc", "del", "dev", dev, "root"], check=False)
            return
        rate = f"{int(rate_bps)}bit"
        burst = str(tc_burst_bytes(rate_bps))
        verb = "change" if self.rate_bps is not None else "replace"
        if self.shaper == "tbf":
            # 'latency' bounds the queue: 200 ms of backlog at the rate (ample for TCP, never drops a burst)
            _run(tc + ["qdisc", verb, "dev", dev, "root", "tbf", "rate", rate, "burst", burst, "latency", "200ms"])
        else:
            quantum = str(min(200_000, max(1514, int(rate_bps / 8 / 10))))
            if verb == "replace":
                _run(tc + ["qdisc", "replace", "dev", dev, "root", "handle", "1:", "htb", "default", "1"])
            _run(tc + ["class", "add" if verb == "replace" else "change", "dev", dev, "parent", "1:", "classid", "1:1",
                       "htb", "rate", rate, "ceil", rate, "burst", burst, "cburst", burst, "quantum", quantum])

    # counters --------------------------------------------------------------
    def tx_bytes(self, h: int) -> int:
        proc = _run(["ip", "-j", "-s", "-n", self.host_ns(h), "link", "show", "dev", IFNAME])
        return int(json.loads(proc.stdout)[0]["stats64"]["tx"]["bytes"])

    def qdisc_stats(self, h: int) -> str:
        return _run(["tc", "-s", "-n", self.host_ns(h), "qdisc", "show", "dev", IFNAME], check=False).stdout


def read_tx_bytes(ifname: str) -> int | None:
    """Transmit counter of ``ifname`` in the *current* network namespace, or ``None`` if unavailable."""
    with contextlib.suppress(OSError, ValueError), open(f"/sys/class/net/{ifname}/statistics/tx_bytes") as fh:
        return int(fh.read().strip())
    # /proc/net/dev always reflects the caller's namespace, even without a private /sys mount
    with contextlib.suppress(OSError, ValueError, IndexError), open("/proc/net/dev") as fh:
        for line in fh:
            name, sep, rest = line.partition(":")
            if sep and name.strip() == ifname:
                return int(rest.split()[8])
    return None
