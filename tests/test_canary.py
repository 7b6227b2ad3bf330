"""The link canary (lightning_gc/auto/canary.py) on spawned gloo ranks, and its rule.

Oracles written by hand: the mean of the values the ranks carried; a verdict from the *fastest*
rank's time (ranks that waited for a late one do not make a fall); a "fell" timed a second time; the
same verdict on every rank; the rule's factor and margin at their boundaries.
"""

from __future__ import annotations

import math
import time

import pytest
import torch
import torch.distributed as dist
from dist_harness import run_distributed

from lightning_gc.auto.canary import LinkCanary, sing
from lightning_gc.comm.cost_model import NetworkModel


def _skewed(rank: int, ws: int) -> dict:
    """Rank r enters the canary 40·r ms late: the early ranks' own times hold their wait for the last
    one, the last rank's does not. Against a model that gives the message 0 s and a 15 ms margin the
    fastest rank's time (about a loopback exchange) says nothing fell, where the slowest (80 ms)
    would. Then a rule any time meets (factor 1, no margin, the same model): "fell", timed twice."""
    out = {"skewed": [], "always": None, "no_model": None}
    quiet = LinkCanary(nbytes=4096, factor=1.0, margin_s=0.015)
    free = NetworkModel(0.0, 0.0)
    for _ in range(3):
        dist.barrier()
        time.sleep(0.04 * rank)
        res = sing(quiet, 1.0 + rank, free, None, ws, torch.device("cpu"))
        out["skewed"].append((res.fell, res.fastest_s, res.carried, res.messages))
    res = sing(LinkCanary(nbytes=4096, factor=1.0, margin_s=0.0), 0.5 * rank, free, None, ws, torch.device("cpu"))
    out["always"] = (res.fell, res.fastest_s, res.carried, res.messages)
    res = sing(LinkCanary(nbytes=4096, factor=1.0, margin_s=0.0), 2.0, None, None, ws, torch.device("cpu"))
    out["no_model"] = (res.fell, res.predicted_s, res.carried, res.messages)
    return out


def test_the_verdict_is_the_fastest_ranks_and_the_same_on_every_rank():
    ws = 3
    results = run_distributed(_skewed, ws)
    for attempt in range(3):
        runs = [res["skewed"][attempt] for res in results]
        assert len(set(runs)) == 1, runs  # identical on every rank, to the bit
        fell, fastest, carried, messages = runs[0]
        assert not fell and fastest < 0.015 and messages == 1, runs
        assert carried == pytest.approx(2.0), runs  # the mean of 1, 2, 3
    always = {res["always"] for res in results}
    assert len(always) == 1, always
    fell, fastest, carried, messages = always.pop()
    assert fell and fastest > 0 and messages == 2 and carried == pytest.approx(0.5), (fell, fastest, carried, messages)
    no_model = {res["no_model"] for res in results}
    assert no_model == {(False, None, 2.0, 1)}, no_model  # without a network model nothing can fall


def test_a_fall_stands_only_if_the_second_message_says_so_too(monkeypatch):
    """sing with its exchange scripted (one process): a first message that says "fell" is timed once
    more; a second that says nothing overturns it; a second that says "fell" too gives the verdict,
    with the second message's time (the first one's spent a shaper's burst)."""
    from lightning_gc.auto import canary as canary_module

    canary = LinkCanary(nbytes=1000, factor=4.0, margin_s=0.02)
    net = NetworkModel(1e-3, 1e-6)  # 4 ms for the message on 4 ranks
    for times, want in (([0.5, 0.003], (False, 0.003, 2)), ([0.5, 0.3], (True, 0.3, 2)), ([0.003], (False, 0.003, 1))):
        script = list(times)
        monkeypatch.setattr(canary_module, "_timed", lambda *a, _s=script: (_s.pop(0), 7.0))
        res = sing(canary, 7.0, net, None, 4, torch.device("cpu"))
        assert (res.fell, res.fastest_s, res.messages) == want and res.carried == 7.0 and not script, (times, res)


def test_the_rule_and_its_options():
    with pytest.raises(ValueError, match="canary_bytes=0"):
        LinkCanary(nbytes=0)
    with pytest.raises(ValueError, match="canary_factor=0.5"):
        LinkCanary(factor=0.5)
    with pytest.raises(ValueError, match="canary_margin_s=nan"):
        LinkCanary(margin_s=math.nan)
    c = LinkCanary(nbytes=1000, factor=4.0, margin_s=0.02)
    assert c.predicted_s(None, 4) is None and not c.fell(10.0, None)
    net = NetworkModel(1e-3, 1e-6)  # 1 ms + 3 copies of 1000 B at 1 µs/B: 4 ms
    assert c.predicted_s(net, 4) == pytest.approx(4e-3)
    assert not c.fell(0.0239, 4e-3) and c.fell(0.024, 4e-3)  # the margin binds: 4 + 20 ms
    small = LinkCanary(nbytes=1000, factor=4.0, margin_s=0.001)
    assert not small.fell(0.0159, 4e-3) and small.fell(0.016, 4e-3)  # the factor binds: 4 x 4 ms


def test_auto_options_name_the_canary():
    from lightning_gc.auto.chooser import AutoConfig

    assert AutoConfig().canary() is None  # off by default
    assert AutoConfig(canary_bytes=65536).canary() == LinkCanary(65536, 4.0, 0.02)
    with pytest.raises(ValueError, match="canary_bytes"):
        AutoConfig(canary_bytes=-1)
    with pytest.raises(ValueError, match="auto_canary_factor=0.9"):
        AutoConfig(canary_factor=0.9)  # checked with the canary off too
