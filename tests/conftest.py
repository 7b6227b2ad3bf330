"""Suite-wide hygiene shared by every test module."""

from __future__ import annotations

import signal
import warnings

import pytest


def pytest_configure(config):
    """Name the modules the ranks' forkserver preloads before any test can start it
    (tests/dist_harness.py, ``START_METHOD``)."""
    from dist_harness import context

    context()


@pytest.fixture(autouse=True)
def _restore_sigint_disposition():
    """Give every test the SIGINT disposition the suite started with.

    Lightning sets SIGINT to ``SIG_IGN`` while it shuts down after a KeyboardInterrupt and while it
    destroys a process group (restoring ``SIG_DFL`` only if that succeeds). A disposition left at
    ``SIG_IGN`` in the pytest process is inherited by every subprocess started later, which then
    ignores Ctrl-C (the bench's Ctrl-C test sets its child's disposition itself for that reason,
    and because pytest run as a background job starts with SIGINT ignored).
    """
    before = signal.getsignal(signal.SIGINT)
    yield
    after = signal.getsignal(signal.SIGINT)
    if after != before:
        signal.signal(signal.SIGINT, before)
        warnings.warn(f"the test changed the SIGINT disposition to {after!r}; restored {before!r}", stacklevel=1)
