"""Rate and bandwidth-schedule parsing for ``lightning-gc bench``."""

from __future__ import annotations

import pytest

from lightning_gc.bench.schedule import (
    Phase,
    Schedule,
    ScheduleError,
    format_rate,
    parse_rate,
    parse_schedule,
)


@pytest.mark.parametrize(
    "text, bps",
    [
        ("100mbit", 100_000_000),
        ("1gbit", 1_000_000_000),
        ("500kbit", 500_000),
        ("2.5gbit", 2_500_000_000),
        ("100Mbit/s", 100_000_000),
        (" 50MBIT ", 50_000_000),
        ("8000bit", 8000),
        ("1e2mbit", 100_000_000),
        (".5gbit", 500_000_000),
    ],
)
def test_parse_rate_accepts_tc_bit_units(text, bps):
    assert parse_rate(text) == bps


@pytest.mark.parametrize(
    "text, fragment",
    [
        ("100mbps", "byte unit"),  # tc would read this as megaBYTES per second
        ("100MB/s", "byte unit"),
        ("100", "not a rate"),
        ("mbit", "not a rate"),
        ("fast", "not a rate"),
        ("100 furlongs", "unknown unit"),
        ("-5mbit", "not a rate"),
        ("1kbit", "below the minimum"),
        ("0mbit", "below the minimum"),
        ("1000tbit", "above"),
    ],
)
def test_parse_rate_rejects_with_value_reason_and_fix(text, fragment):
    with pytest.raises(ScheduleError) as exc:
        parse_rate(text)
    msg = str(exc.value)
    assert repr(text) in msg and fragment in msg
    assert any(fix in msg for fix in ("e.g.", "use ", "write ", "leave "))


def test_parse_rate_rejects_non_string():
    with pytest.raises(ScheduleError, match="expected a string"):
        parse_rate(100)


@pytest.mark.parametrize("bps, text", [(100_000_000, "100mbit"), (1_000_000_000, "1gbit"), (1_500_000, "1.5mbit"),
                                       (500_000, "500kbit"), (None, "unshaped")])
def test_format_rate_round_trips(bps, text):
    assert format_rate(bps) == text
    if bps is not None:
        assert parse_rate(format_rate(bps)) == bps


def test_inline_schedule_from_the_issue():
    s = parse_schedule("0:1gbit,0.33:50mbit,0.66:200mbit")
    assert s.phases == (Phase(0.0, 10**9), Phase(0.33, 50 * 10**6), Phase(0.66, 200 * 10**6))
    assert s.initial_rate_bps == 10**9 and not s.is_constant
    # fractions map to steps by rounding
    assert s.boundaries(30) == [(0, 10**9), (10, 50 * 10**6), (20, 200 * 10**6)]
    assert s.boundaries(100) == [(0, 10**9), (33, 50 * 10**6), (66, 200 * 10**6)]
    rates = [s.rate_at_step(i, 30) for i in range(30)]
    assert rates == [10**9] * 10 + [50 * 10**6] * 10 + [200 * 10**6] * 10


def test_percentages_and_single_rate():
    s = parse_schedule("0%:100mbit, 50%:10mbit")
    assert s.phases == (Phase(0.0, 10**8), Phase(0.5, 10**7))
    one = parse_schedule("100mbit")
    assert one.is_constant and one.initial_rate_bps == 10**8
    assert Schedule.constant(10**8).boundaries(5) == [(0, 10**8)]


def test_schedule_file_with_comments_and_both_separators(tmp_path):
    f = tmp_path / "net.sched"
    f.write_text("# unpredictable network\n0 1gbit\n\n0.25:50mbit   # congestion\n0.5 200mbit, 0.75:1gbit\n")
    s = parse_schedule(str(f))
    assert [p.rate_bps for p in s.phases] == [10**9, 50 * 10**6, 200 * 10**6, 10**9]
    assert [p.at for p in s.phases] == [0.0, 0.25, 0.5, 0.75]
    assert s.source == str(f)
    assert s.to_json()[1] == {"at": 0.25, "rate": "50mbit", "rate_bps": 50_000_000}


@pytest.mark.parametrize(
    "spec, fragment",
    [
        ("", "empty"),
        ("0.5:100mbit", "add a first entry at 0"),
        ("0:1gbit,0.5:10mbit,0.4:1mbit", "strictly increasing"),
        ("0:1gbit,0.5:10mbit,0.5:1mbit", "strictly increasing"),
        ("0:1gbit,1:10mbit", "outside [0, 1)"),
        ("0:1gbit,-0.1:10mbit", "outside [0, 1)"),
        ("0:1gbit,half:10mbit", "not a fraction"),
        ("0:1gbit,0.5:10mbps", "byte unit"),
        ("0:1gbit,0.5", "not AT:RATE"),
        ("no/such/file.sched", "no such file"),
        ("# only a comment", "no entries"),
    ],
)
def test_bad_schedules_name_value_reason_and_fix(spec, fragment, tmp_path):
    if spec == "# only a comment":
        f = tmp_path / "empty.sched"
        f.write_text(spec + "\n")
        spec = str(f)
    with pytest.raises(ScheduleError) as exc:
        parse_schedule(spec)
    assert fragment in str(exc.value)


def test_phase_that_would_never_apply_is_an_error_not_dropped():
    s = parse_schedule("0:1gbit,0.33:50mbit,0.34:200mbit")
    with pytest.raises(ScheduleError, match=r"use more --steps \(at least \d+\)"):
        s.boundaries(10)  # 0.33 and 0.34 both round to step 3
    assert s.min_steps() <= 100
    s.boundaries(s.min_steps())  # the suggested length works
    with pytest.raises(ScheduleError, match="at least 1 step"):
        s.boundaries(0)
