"""objckpt.planner: Young/Daly interval and the overhead / expected-loss table."""

from __future__ import annotations

import math

import pytest

from objckpt.errors import ConfigError
from objckpt.planner import (
    daly_interval,
    evaluate,
    format_duration,
    make_plan,
    parse_duration,
    suggest_interval,
    young_interval,
)

MIN = 60.0
DAY = 86400.0


def test_seed_example_figures():
    # The seed's worked example: a 12 s save.
    every20 = evaluate(20 * MIN, save_seconds=12, mtbf_seconds=DAY)
    assert every20.overhead == pytest.approx(0.01)
    assert every20.expected_loss_s == pytest.approx(10 * MIN)
    every5 = evaluate(5 * MIN, save_seconds=12, mtbf_seconds=DAY)
    assert every5.overhead == pytest.approx(0.04)
    assert every5.expected_loss_s == pytest.approx(2.5 * MIN)


def test_restart_cost_adds_to_expected_loss():
    row = evaluate(20 * MIN, save_seconds=12, mtbf_seconds=DAY, restart_seconds=90)
    assert row.expected_loss_s == pytest.approx(10 * MIN + 90)


def test_young_and_daly():
    assert young_interval(12, DAY) == pytest.approx(math.sqrt(2 * 12 * DAY))
    c, m = 12.0, DAY
    r = c / (2 * m)
    expected = math.sqrt(2 * c * m) * (1 + math.sqrt(r) / 3 + r / 9) - c
    assert daly_interval(c, m) == pytest.approx(expected)
    # Daly's refinement is a small correction below Young's for C << M
    assert 0.98 * young_interval(c, m) < daly_interval(c, m) < young_interval(c, m)
    # a save costing more than 2 x MTBF: checkpoint once per MTBF
    assert daly_interval(100, 10) == 10


def test_daly_minimises_expected_waste():
    c, m, rst = 30.0, 6 * 3600.0, 120.0
    best = evaluate(daly_interval(c, m), save_seconds=c, mtbf_seconds=m, restart_seconds=rst)
    for factor in (0.5, 0.8, 1.25, 2.0):
        other = evaluate(best.interval_s * factor, save_seconds=c, mtbf_seconds=m, restart_seconds=rst)
        assert best.expected_waste < other.expected_waste


def test_plan_rows_default_candidates_and_optimum():
    plan = make_plan(12, DAY)
    plain = [r.interval_s for r in plan.rows if not r.label]
    assert plain == [300, 600, 1200, 1800, 3600]
    assert {r.label for r in plan.rows} == {"", "young", "daly"}
    assert plan.optimum.interval_s == pytest.approx(plan.daly_s)
    assert [r.interval_s for r in plan.rows] == sorted(r.interval_s for r in plan.rows)
    d = plan.to_dict()
    assert d["recommended_interval_seconds"] == pytest.approx(plan.daly_s)
    assert len(d["rows"]) == 7


def test_step_time_rounds_to_whole_steps():
    row = evaluate(1000, save_seconds=10, mtbf_seconds=DAY, step_seconds=3)
    assert row.every_steps == 333
    assert row.interval_s == pytest.approx(999)
    assert evaluate(1, save_seconds=10, mtbf_seconds=DAY, step_seconds=3).every_steps == 1


def test_suggest_interval_uses_median_and_bounds():
    s = suggest_interval([12, 11, 13, 500], DAY, step_seconds=2)
    assert s.save_s == pytest.approx(12.5)
    assert s.every_steps == round(daly_interval(12.5, DAY) / 2)
    assert "Daly" in s.reason
    capped = suggest_interval(12, DAY, max_interval_seconds=600)
    assert capped.interval_s == 600 and "capped" in capped.reason
    raised = suggest_interval(12, DAY, min_interval_seconds=7200)
    assert raised.interval_s == 7200
    # MTBF so short the optimum costs 10 %: ask for at most 2 %
    lengthened = suggest_interval(60, 3600, max_overhead=0.02)
    assert lengthened.row.overhead == pytest.approx(0.02)
    with pytest.raises(ConfigError):
        suggest_interval([], DAY)


@pytest.mark.parametrize(
    "text, seconds",
    [
        ("12s", 12),
        ("20m", 1200),
        ("20min", 1200),
        ("6h", 21600),
        ("1.5h", 5400),
        ("1h30m", 5400),
        ("250ms", 0.25),
        ("3d", 259200),
        ("90", 90),
        (45, 45),
    ],
)
def test_parse_duration(text, seconds):
    assert parse_duration(text) == pytest.approx(seconds)


@pytest.mark.parametrize("text", ["", "x", "12 parsecs", "-3s", "1h 2", "s"])
def test_parse_duration_rejects(text):
    with pytest.raises(ConfigError):
        parse_duration(text)


@pytest.mark.parametrize("bad", [0, -1, float("nan"), float("inf")])
def test_bad_mtbf_is_config_error(bad):
    with pytest.raises(ConfigError):
        make_plan(12, bad)


def test_format_duration():
    assert format_duration(12) == "12s"
    assert format_duration(150) == "2.5min"
    assert format_duration(5400) == "1.5h"


def test_save_not_small_against_mtbf_warns():
    assert make_plan(12, DAY).warnings == () and not make_plan(12, DAY).infeasible
    assert suggest_interval(12, DAY).warnings == ()
    plan = make_plan(10 * MIN, 60 * MIN)  # save > MTBF / 10: the figures are rough, but usable
    assert len(plan.warnings) == 1 and "not small against the MTBF" in plan.warnings[0]
    assert not plan.infeasible and plan.optimum.interval_s > 10 * MIN
    assert plan.to_dict()["warnings"] == list(plan.warnings)
    s = suggest_interval(10 * MIN, 60 * MIN)
    assert len(s.warnings) == 1 and s.interval_s == pytest.approx(daly_interval(600, 3600))


def test_interval_below_the_save_is_flagged_and_suggestions_clamped():
    # the example: a 1 h save and a 1 h MTBF gave "every 49.6 min: 121.0% overhead"
    plan = make_plan(3600, 3600)
    assert plan.optimum.interval_s == pytest.approx(2974, abs=1) and plan.infeasible
    assert any("shorter than the save" in w for w in plan.warnings)
    assert plan.to_dict()["infeasible"] is True
    s = suggest_interval(3600, 3600)
    assert s.interval_s == pytest.approx(3600) and s.row.overhead <= 1.0
    assert any("shorter than the save" in w for w in s.warnings) and "raised to the save" in s.reason
    # rounding to whole steps never goes back below the save
    stepped = suggest_interval(100, 100, step_seconds=30)
    assert stepped.interval_s >= 100 and stepped.every_steps == 4
    capped = suggest_interval(600, DAY, max_interval_seconds=60)  # a cap below the save loses
    assert capped.interval_s == pytest.approx(600) and capped.warnings
