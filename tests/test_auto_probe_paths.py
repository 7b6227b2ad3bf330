"""``auto``'s looks at the link (the bandwidth probe's size, the link check, β from a dense step) on a
simulated shaped link. They enter through the chooser's decider (``chooser.decider.decide``) and patch
the link's entry points (``lightning_gc.comm.link.probe_network``, ``LinkIO.probe``, ``LinkIO.check``):
a warm-up decision that probes is reached otherwise only through a profiled, measured warm-up on a real
process group. Everything else auto does is tested through public names in
tests/test_auto_chooser_behaviour.py and tests/test_auto_policy_behaviour.py."""

from __future__ import annotations

import pytest
from auto_oracle import step_by_hand

from lightning_gc.auto.look import LinkIO
from lightning_gc.auto.model import (
    MethodCost,
    Workload,
)
from lightning_gc.comm.cost_model import NetworkModel
from lightning_gc.comm.link import LinkObserver, SizedProbe

# ---------------------------------------------------------------------- the re-decision trigger
BURST = 64 * 1024  # the bench shaper's token bucket (lightning_gc/bench/netns.py: tc_burst_bytes)


class _FakeEngine:
    """Just what AutoChooser's drift path touches (one process: agreement is the identity)."""

    def __init__(self, network):
        from types import SimpleNamespace

        import torch

        self.world_size, self.process_group, self.step, self.device = 4, None, 0, torch.device("cpu")
        self.network = SimpleNamespace(pinned=True, model=network)
        self.link = LinkObserver(world_size=4)  # its schedule is the clock of auto's periodic look
        self.plan = SimpleNamespace(groups=[SimpleNamespace(gid=0, exact=False)])
        self.config = SimpleNamespace(warmup_steps=1, seed=0)
        self.calls: list = []
        self.dense_mode = None  # as GCEngine: a dense mode runs every step on DDP's buckets
        self.last_step = None  # _walls sets it: the stats of the step that just ended
        self.carried = None  # carry_wall's value, for the next step's closing report
        self.dense_carry = False  # enable_dense_carry: dense steps carry it too (in their first bucket)

    def enable_dense_carry(self):
        self.dense_carry = True

    def step_is_dense(self):
        return self.dense_mode is not None

    def carry_wall(self, wall_s):
        self.carried = wall_s

    def raise_warmup_steps(self, steps):
        pass

    def shorten_warmup_steps(self, steps):
        self.config.warmup_steps = min(self.config.warmup_steps, steps)

    def synchronize(self):
        pass

    def set_dense_mode(self, mode):
        self.calls.append(("dense", mode))
        self.dense_mode = mode

    def set_group_method(self, gid, spec):
        self.calls.append(("slot", spec.compressor))

    def adopt_network(self, model):  # an unpinned network: the chooser's agreed model
        self.network.model = model


def test_the_warm_up_dense_step_scales_every_probed_beta(monkeypatch):
    """The probe under-reads a slow link (small messages, the slowest rank's view); the profiled DDP
    step, shorter than the probed β predicts, sets a scale that every later probe gets too."""
    import torch

    from lightning_gc.auto.chooser import AutoChooser, AutoConfig

    wl = Workload(0.01, (0.01, 0.01), (500_000, 500_000))
    costs = [MethodCost("ddp", "bucket", 0.0), MethodCost("topk", "allgather", 0.0, 80_000.0, 0.5, True)]
    engine = _FakeEngine(None)
    engine.network.pinned = False
    engine.adopt_network = lambda net: engine.calls.append(("adopt", net.beta_s_per_byte))
    probes = iter([NetworkModel(1e-4, 8 / 10e6), NetworkModel(1e-4, 8 / 5e6)])  # 10 Mbit/s, then 5
    monkeypatch.setattr(LinkIO, "probe", lambda self, latency=None: SizedProbe(next(probes), 0, 0.0))
    ch = AutoChooser(engine, AutoConfig(candidates=("ddp", "topk"), probe_every=0), torch.nn.Linear(1, 1), [])
    ch.workload, ch.costs = wl, costs
    d = dict(wl.as_dict(), other_s=0.0)
    wall = step_by_hand(costs[0].as_dict(), d, 1e-4, 8 / 16e6, 4)  # the DDP step ran as at 16 Mbit/s
    ch.decider.decide(1, "warmup", probe=True, dense_wall_s=wall)
    assert ch.beta_scale == pytest.approx(10 / 16, rel=1e-6)
    assert ch.network.beta_s_per_byte == pytest.approx(8 / 16e6, rel=1e-6)
    assert ch.workload.other_s == pytest.approx(0.0, abs=1e-9)  # the link explains the step
    assert ch.history[-1]["beta_scale"] == ch.beta_scale and engine.calls[0] == ("adopt", ch.network.beta_s_per_byte)
    ch.decider.decide(50, "periodic", probe=True)
    assert ch.network.beta_s_per_byte == pytest.approx(8 / 5e6 * 10 / 16, rel=1e-6)
    state = ch.state_dict()
    other = AutoChooser(engine, AutoConfig(candidates=("ddp", "topk"), probe_every=0), torch.nn.Linear(1, 1), [])
    other.load_state_dict(state)
    assert other.beta_scale == ch.beta_scale


def _window(chooser, step, wall):
    chooser.walls.window = [wall, wall]
    chooser._check_drift(step)


def _fp16_measured_on_a_fast_link(monkeypatch, **cfg):
    """fp16 picked at a 10 Gbit/s link and measured 30 ms under the raw model (the warm-up's slow
    compute); lowrank and Top-k are the compressed candidates. Returns the chooser, its engine and
    the costs and workload."""
    import torch

    from lightning_gc.auto.chooser import AutoChooser, AutoConfig

    wl = Workload(0.002, (0.002,), (1_000_000,))
    costs = [MethodCost("ddp", "bucket", 0.0), MethodCost("fp16", "bucket", 0.0005),
             MethodCost("lowrank", "lowrank", 0.002, 40_000.0, 0.3, True),
             MethodCost("topk", "allgather", 0.001, 20_000.0, 0.5, True)]
    engine = _FakeEngine(NetworkModel(1e-4, 8 / 1e10))
    # the figures below are set for a progress weight of 1 (Top-k's measured window must beat lowrank's)
    cfg = AutoConfig(**{"candidates": ("ddp", "fp16", "lowrank", "topk"), "window": 2, "explore": 1,
                        "probe_every": 0, "family_margin": 0.0, "progress_weight": 1.0, **cfg})
    chooser = AutoChooser(engine, cfg, torch.nn.Linear(1, 1), [])
    chooser.workload, chooser.costs = wl, costs
    chooser.decider.decide(0, "warmup", probe=False, dense_wall_s=0.04)
    assert chooser.chosen == "fp16"
    _window(chooser, 2, 1.0)
    _window(chooser, 4, chooser.predictions["fp16"].step_s - 0.03)
    assert chooser.state.corrections["fp16"] == pytest.approx(-0.03) and chooser.chosen == "fp16"
    return chooser, engine, costs, wl


def _step_end(chooser, step, wall, exchange_s=None):
    """One step's end for the every-step tests: its wall and (compressed steps) its agreed exchange."""
    from types import SimpleNamespace

    engine = chooser.engine
    if isinstance(engine, _FakeEngine):
        dense, carried, engine.carried = engine.step_is_dense(), engine.carried, None
        lost = dense and not engine.dense_carry  # GCEngine: a dense step carries it only when enabled
        engine.last_step = SimpleNamespace(step=step, dense=dense, dense_stopped=False, carried_wall_mean_s=None if lost else carried,
                                           exchange_comm_mean_s=exchange_s,
                                           exchange_comm_mean_step=None)
    chooser._watch_step(step, wall)


def _lowrank_with_an_exchange_reference(monkeypatch, exchange_s, **cfg):
    """The link fell to 10 Mbit/s; a drift decision at step 6 moved fp16 to lowrank; its reference
    window (steps 9-12, the calibration at 12 keeps it) ran its predicted step, each step with
    ``exchange_s`` in the compressed exchange (agreed; or one value per step, a list)."""
    chooser, engine, _, _ = _fp16_measured_on_a_fast_link(monkeypatch, min_interval=4, explore=0, **cfg)
    engine.network.model = NetworkModel(1e-4, 8 / 1e7)
    chooser.decider.decide(6, "drift", probe=True)
    assert chooser.chosen == "lowrank"
    _window(chooser, 8, 1.0)  # settling
    step_s = chooser.predictions["lowrank"].step_s
    per_step = exchange_s if isinstance(exchange_s, list) else [exchange_s] * 4
    for s, x in zip(range(9, 13), per_step):
        _step_end(chooser, s, step_s, x)
    _window(chooser, 12, step_s)
    assert [(h["step"], h["trigger"]) for h in chooser.history][-1] == (12, "calibration")
    assert chooser.chosen == "lowrank" and chooser.state.reference == pytest.approx(step_s)
    return chooser, engine, step_s


@pytest.mark.parametrize("test", ["exchange", "steps"])
def test_a_faster_exchange_checks_the_link_before_probing_and_a_severe_step_probes_at_once(monkeypatch, test):
    """On an unpinned network: the exchange test's decision first times the check message, and a
    check within probe_check of the last probe keeps the stored network without a probe (a shaper's
    burst on an unchanged link); the step test's decision (a fall or rise of 2x or more) probes at once."""

    chooser, engine, step_s = _lowrank_with_an_exchange_reference(monkeypatch, 0.02)
    engine.network.pinned = False
    engine.adopt_network = lambda net: None
    chooser.probe_bytes, chooser.probe_time_s = 100_000, 0.08
    calls = []
    monkeypatch.setattr(LinkIO, "check", lambda self, size: calls.append("check") or (0.08, 8e-7))
    monkeypatch.setattr(LinkIO, "probe", lambda self, latency=None: calls.append("probe") or SizedProbe(
        chooser.network, chooser.probe_bytes, chooser.probe_time_s))
    stored = chooser.network
    walls = {"exchange": (step_s, 0.002), "steps": (5 * step_s, 0.02)}[test]
    for s in range(13, 17):
        _step_end(chooser, s, *walls)
    h = chooser.history[-1]
    # the exchange test reads this step's agreed time (step 13, right after the calibration at 12, is left
    # out: the median over 12, 14, 15 is fast at 15); the step test reads each wall one step later (at 16,
    # where two of the last 3 are 5x: the median at twice the factor)
    assert (h["step"], h["trigger"], h["drift_test"]) == ({"exchange": 15, "steps": 16}[test], "drift", test)
    if test == "exchange":
        assert calls == ["check"] and h["network_source"] == "check" and h["link_check"]["unchanged"]
        assert chooser.network == stored and chooser.chosen == "lowrank"
    else:
        assert calls == ["probe"] and h["link_check"] is None and h["network_source"] == "probe"


# ---------------------------------------------------------------------- the link check of a re-decision
class _ShapedProbe:
    """Stands in for ``probe_network`` on a simulated tc-shaped link (α + bytes above the bucket · β),
    recording every message a real probe would send: ``warmup + repeats`` runs of every size."""

    def __init__(self, rate_bps: float) -> None:
        self.alpha, self.beta, self.sent, self.noise = 2e-4, 8 / rate_bps, [], 2.3e-3
        self.stalls: list[float] = []  # seconds added to the next calls' times (a descheduled rank)

    def __call__(self, group, config, device=None):
        from types import SimpleNamespace

        self.sent.extend(list(config.sizes_bytes) * (config.warmup + config.repeats))
        stall = self.stalls.pop(0) if self.stalls else 0.0
        times = tuple(self.alpha + max(s - BURST, 0) * self.beta + stall for s in config.sizes_bytes)
        # a busy host: scheduling delays add 2.3 ms to every size's median (a constant, so the slope
        # keeps β), while the fastest repeat got through undelayed
        return SimpleNamespace(sizes_bytes=tuple(config.sizes_bytes), min_times_s=times,
                               median_times_s=tuple(t + self.noise for t in times))


def _probing_chooser(monkeypatch, rate_bps: float, **cfg):
    """An AutoChooser on the quickstart MLP's size (the probe's cap is half its gradient) whose probes
    go to a simulated shaped link; one process, so the agreement is the identity."""
    import torch

    from lightning_gc.auto.chooser import AutoChooser, AutoConfig
    from lightning_gc.comm import link as link_mod

    link = _ShapedProbe(rate_bps)
    monkeypatch.setattr(link_mod, "probe_network", link)
    engine = _FakeEngine(None)
    engine.network.pinned = False
    engine.adopt_network = lambda net: None
    params = [("w", torch.zeros(84_000, requires_grad=True))]
    ch = AutoChooser(engine, AutoConfig(**{"candidates": ("ddp", "topk"), **cfg}), torch.nn.Linear(1, 1), params)
    ch.workload = Workload(0.001, (0.001,), (84_000,))
    ch.costs = [MethodCost("ddp", "bucket", 0.0), MethodCost("topk", "allgather", 0.0, 8_000.0, 0.5, True)]
    return ch, link, engine, params


@pytest.mark.parametrize("rate_bps, rounds", [(20e6, 1), (1e9, 2)])
def test_a_small_model_starts_at_half_its_gradient_and_grows_to_1_mib_on_a_fast_link(monkeypatch, rate_bps, rounds):
    """The quickstart MLP (84k parameters), through the chooser's own probe on a simulated shaped link:
    the first round times 168 kB, half its fp32 gradient (not 256 KiB: on a slow link that round is
    several of its dense steps), and 80 KiB. At 20 Mbit/s that message is bandwidth-bound (67 ms) and
    the probe stops; at 1 Gbit/s it takes 1.6 ms, in the scheduling noise of a busy host, and the
    probe grows it to 1 MiB (the model's size no longer caps the growth). Either way β is the link's."""
    from lightning_gc.comm.link import (
        PROBE_LATENCY,
        PROBE_MAX_BYTES,
        PROBE_TARGET_S,
        next_probe_bytes,
        probe_start_bytes,
    )

    ch, link, _, _ = _probing_chooser(monkeypatch, rate_bps)
    ch.decider.decide(1, "warmup", probe=True)
    start = probe_start_bytes(4 * 84_000)
    assert start == 2 * 84_000
    per_size = PROBE_LATENCY.warmup + PROBE_LATENCY.repeats
    bandwidth = link.sent[len(PROBE_LATENCY.sizes_bytes) * per_size:]  # after the latency round
    want = [80 * 1024, start] * 4  # one warm-up and three timed runs of each size
    if rounds == 2:  # grown by 20 ms over the first message's (median) time, 3.3 ms here: 1.01 MB
        t_large = link.alpha + (start - BURST) * link.beta + link.noise
        grown = round(start * PROBE_TARGET_S / t_large)
        assert start * 4 < grown <= PROBE_MAX_BYTES
        want += [grown // 4, grown] * 3  # no warm-up run: the first round warmed the connections
    assert bandwidth == want and ch.probe_bytes == want[-1]
    assert ch.network.beta_s_per_byte == pytest.approx(8 / rate_bps, rel=1e-9)
    assert next_probe_bytes(1000, PROBE_TARGET_S / 4, 10**9) is None  # long enough
    assert next_probe_bytes(1000, PROBE_TARGET_S / 2000, 10**9) == 1000 * 2000  # x target / time
    assert next_probe_bytes(1000, PROBE_TARGET_S / 4.5, 10**9) == 4500
    assert next_probe_bytes(1000, 1e-6, 5000) == 5000  # never past the cap


@pytest.mark.parametrize("check", [1.5, 0.0])
def test_a_re_decision_checks_the_link_with_one_message_and_probes_again_only_when_it_moved(monkeypatch, check):
    import torch

    from lightning_gc.auto.chooser import AutoChooser, AutoConfig

    ch, link, engine, params = _probing_chooser(monkeypatch, 20e6, probe_check=check)
    cap = 2 * 84_000
    ch.decider.decide(1, "warmup", probe=True)
    small = 80 * 1024  # a quarter of the cap would sit inside the shaper's bucket: floored above it
    full_probe = [64, 256] * 8 + [small, cap] * 4  # latency (1 warm-up + 7), then one sized round
    assert link.sent == full_probe and ch.probe_bytes == cap
    assert ch.probe_time_s == pytest.approx(2e-4 + (cap - BURST) * 8 / 20e6 + link.noise)
    # α from the fastest 64-byte shift, not the median that the host's noise inflated to 2.5 ms
    assert ch.network.alpha_s == pytest.approx(2e-4 - 64 * 8 / 20e6)
    assert ch.history[-1]["link_check"] is None  # a first decision always probes in full
    beta_20 = ch.network.beta_s_per_byte
    assert beta_20 == pytest.approx(8 / 20e6)

    link.sent = []
    ch.decider.decide(101, "periodic", probe=True)  # the same link
    if check:
        assert link.sent == [small, cap]  # the check alone: a quarter of the probe's sized round
        assert ch.history[-1]["link_check"] == {"check_s": ch.probe_time_s, "probe_s": ch.probe_time_s,
                                                "bytes": cap, "unchanged": True, "retimed": False,
                                                "reference": "measured"}
    else:
        assert link.sent == full_probe and ch.history[-1]["link_check"] is None
    assert ch.network.beta_s_per_byte == pytest.approx(beta_20)

    if check:  # one check message stalled (0.4 s, a descheduled rank): timed again, the faster kept
        link.sent, link.stalls = [], [0.4]
        ch.decider.decide(151, "periodic", probe=True)
        assert link.sent == [small, cap] * 2 and ch.history[-1]["link_check"]["retimed"]
        assert ch.history[-1]["link_check"]["unchanged"] and ch.history[-1]["network_source"] == "check"
        assert ch.network.beta_s_per_byte == pytest.approx(beta_20)

    link.sent, link.beta = [], 8 / 10e6  # the link fell to 10 Mbit/s: the check moved ~2x, twice
    ch.decider.decide(201, "drift", probe=True)
    # the check's message is bandwidth-bound (its 80 ms > 5 ms): its slope is the new β, no full probe
    assert link.sent == ([small, cap] * 2 if check else full_probe)
    assert ch.network.beta_s_per_byte == pytest.approx(8 / 10e6)
    # α kept from the last full probe with the check (that probe's 64-byte term at 20 Mbit/s); probed without
    assert ch.network.alpha_s == pytest.approx(2e-4 - 64 * 8 / (20e6 if check else 10e6))
    if check:
        moved = ch.history[-1]["link_check"]
        assert not moved["unchanged"] and moved["retimed"] and moved["check_s"] / moved["probe_s"] > 1.5
        assert moved["beta_s_per_byte"] == pytest.approx(8 / 10e6) and ch.history[-1]["network_source"] == "check_slope"
        assert ch.probe_time_s == pytest.approx(2e-4 + (cap - BURST) * 8 / 10e6 + link.noise)  # the new reference

    link.sent, link.beta = [], 8 / 10e6 * 1.4  # 40 % slower, inside the 1.5x check: the network is kept
    ch.decider.decide(301, "periodic", probe=True)
    assert link.sent == ([small, cap] if check else full_probe)
    assert ch.network.beta_s_per_byte == pytest.approx(8 / 10e6 if check else 8 / 10e6 * 1.4)

    if check:  # back to 1 Gbit/s: the check moved, but its message (3.6 ms) is not bandwidth-bound: full probe
        link.sent, link.beta = [], 8 / 1e9
        ch.decider.decide(401, "periodic", probe=True)
        assert link.sent[:4] == [small, cap] * 2 and link.sent[4:20] == [64, 256] * 8
        assert ch.history[-1]["network_source"] == "probe" and not ch.history[-1]["link_check"]["unchanged"]
        assert ch.network.beta_s_per_byte == pytest.approx(8 / 1e9)

    state = ch.state_dict()  # the reference travels with a checkpoint
    other = AutoChooser(engine, AutoConfig(candidates=("ddp", "topk"), probe_check=check), torch.nn.Linear(1, 1),
                        params)
    other.load_state_dict(state)
    assert (other.probe_bytes, other.probe_time_s) == (ch.probe_bytes, ch.probe_time_s)


@pytest.mark.parametrize("exposed_s, dense_probe_s", [(0.2, 0.1), (0.05, 0.1), (0.2, 0.0)])
def test_a_dense_step_that_waited_on_the_network_measures_beta_instead_of_the_bandwidth_probe(
        monkeypatch, exposed_s, dense_probe_s):
    """A profiled DDP step that waited at least dense_probe_s for its buckets sets β: the value at which
    the hand-written DDP step (tests/auto_oracle.py) equals the measured wall, with other_s = 0; only the
    latency round is sent. Below the threshold, or with it off, the bandwidth probe runs as before."""

    ch, link, _, _ = _probing_chooser(monkeypatch, 26e6, dense_probe_s=dense_probe_s)  # the probe would read 26
    wl = ch.workload = Workload(0.0004, (0.0001, 0.0001), (42_000, 42_000))
    costs = ch.costs
    true_beta = 8 / 20e6
    alpha = link.alpha - 64 * true_beta  # the latency round's fastest 64-byte shift is α + 64·β
    wall = step_by_hand(costs[0].as_dict(), dict(wl.as_dict(), other_s=0.0), alpha, true_beta, 4)
    ch.decider.decide(1, "warmup", probe=True, dense_wall_s=wall, dense_exposed_s=exposed_s)
    h = ch.history[-1]
    if exposed_s >= dense_probe_s > 0:
        assert link.sent == [64, 256] * 8  # the latency round alone: no bandwidth probe, no reference message
        assert ch.network.beta_s_per_byte == pytest.approx(true_beta, rel=1e-6)
        assert ch.network.alpha_s == pytest.approx(alpha, rel=1e-6)
        assert ch.workload.other_s == pytest.approx(0.0, abs=1e-9)  # the link explains the whole step
        assert h["network_source"] == "dense_step"
        # the link check's reference: the model's time for the probe's large message (half the gradient,
        # bandwidth-bound at 20 Mbit/s), α + bytes·β by hand
        assert ch.probe_bytes == 2 * 84_000
        assert ch.probe_time_s == pytest.approx(alpha + 2 * 84_000 * true_beta, rel=1e-6)
        assert ch.probe_time_modelled
    else:
        assert link.sent == [64, 256] * 8 + [80 * 1024, 2 * 84_000] * 4
        assert h["network_source"] == "probe"
        # the probe over-read the link (26 Mbit/s): the DDP step, slower than it predicts, is other's
        assert ch.network.beta_s_per_byte == pytest.approx(8 / 26e6, rel=1e-6)


@pytest.mark.parametrize("noise", ["model-like", "burst"])
def test_a_modelled_reference_is_replaced_by_the_first_check_on_the_link(monkeypatch, noise):
    """After a dense step measured β, the first periodic check is compared with the model's time for its
    message. A check the model describes (the stub's scheduling delay equal to the shaper's burst, so the
    check takes α + bytes·β): unchanged, one message, and its own time is the reference from then on. A
    check that reads 0.66x the model (the stub's 64 KiB burst passes at line rate, below 1/1.5): moved,
    timed again, and being bandwidth-bound it sets β from its slope, which is the link's: the same β,
    no full probe, two messages. Either way the next check is judged against a measured time."""
    import torch

    from lightning_gc.auto.chooser import AutoChooser, AutoConfig

    ch, link, engine, params = _probing_chooser(monkeypatch, 20e6, dense_probe_s=0.1)
    wl = ch.workload = Workload(0.0004, (0.0001, 0.0001), (42_000, 42_000))
    true_beta, cap, small = 8 / 20e6, 2 * 84_000, 80 * 1024
    alpha = link.alpha - 64 * true_beta
    wall = step_by_hand(ch.costs[0].as_dict(), dict(wl.as_dict(), other_s=0.0), alpha, true_beta, 4)
    ch.decider.decide(1, "warmup", probe=True, dense_wall_s=wall, dense_exposed_s=0.2)
    assert ch.probe_time_modelled and ch.history[-1]["network_source"] == "dense_step"
    modelled = alpha + cap * true_beta
    state = ch.state_dict()  # the flag travels with a checkpoint
    other = AutoChooser(engine, AutoConfig(candidates=("ddp", "topk")), torch.nn.Linear(1, 1), params)
    other.load_state_dict(state)
    assert (other.probe_time_s, other.probe_time_modelled) == (pytest.approx(modelled), True)

    if noise == "model-like":
        link.noise = BURST * true_beta
    check_s = link.alpha + (cap - BURST) * true_beta + link.noise  # the stub's median time of the check
    link.sent = []
    ch.decider.decide(101, "periodic", probe=True)
    lc = ch.history[-1]["link_check"]
    assert lc["reference"] == "modelled" and lc["probe_s"] == pytest.approx(modelled)
    if noise == "model-like":
        assert check_s / modelled == pytest.approx(1.0, abs=0.01)
        assert link.sent == [small, cap] and lc["unchanged"] and ch.history[-1]["network_source"] == "check"
    else:
        assert check_s / modelled < 1 / 1.5
        assert link.sent == [small, cap] * 2 and not lc["unchanged"] and lc["retimed"]
        assert ch.history[-1]["network_source"] == "check_slope"
    assert ch.network.beta_s_per_byte == pytest.approx(true_beta, rel=1e-6)
    assert (ch.probe_time_s, ch.probe_time_modelled) == (pytest.approx(check_s), False)

    link.sent = []
    ch.decider.decide(201, "periodic", probe=True)  # the same link, against the measured reference: one message
    lc = ch.history[-1]["link_check"]
    assert link.sent == [small, cap] and lc["unchanged"] and lc["reference"] == "measured"
    assert ch.history[-1]["network_source"] == "check"


def test_a_severe_drift_probes_at_once_and_a_moderate_one_checks_the_link_first(monkeypatch):
    ch, link, _, _ = _probing_chooser(monkeypatch, 20e6, window=2, patience=2, min_interval=1, probe_every=0)
    ch.decider.decide(1, "warmup", probe=True)
    full_probe = [64, 256] * 8 + [80 * 1024, 2 * 84_000] * 4
    step = ch.predictions[ch.chosen].step_s

    def window(at, wall):
        ch.walls.window = [wall, wall]
        ch._check_drift(at)

    window(3, 1.0)  # settling
    window(5, step)  # reference (and calibration)
    link.sent = []
    window(7, 1.5 * step)
    window(9, 1.5 * step)  # +50 % for two windows: a moderate drift checks the link first; unchanged
    assert ch.history[-1]["trigger"] == "drift" and link.sent == [80 * 1024, 2 * 84_000]
    window(11, 1.0)
    window(13, step)  # the new reference
    link.sent = []
    window(15, 3 * step)  # 3x in one window: severe, the full probe without a check
    assert ch.history[-1]["trigger"] == "drift" and link.sent == full_probe
    assert ch.history[-1]["link_check"] is None and ch.history[-1]["network_source"] == "probe"


