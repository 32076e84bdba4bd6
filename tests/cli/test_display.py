from datetime import UTC, datetime, timedelta

import pytest

from freetoken.cli import display as d

NOW = datetime(2026, 1, 1, 12, 0, 0, tzinfo=UTC)


@pytest.mark.parametrize(
    "n, text",
    [
        (0, "0 B"),
        (999, "999 B"),
        (767_000, "767 KB"),
        (1_000_000, "1 MB"),
        (1_234_567_890, "1.2 GB"),
        (19_100_000_000, "19 GB"),
        (123_400_000_000, "123 GB"),
        (2_500_000_000_000, "2.5 TB"),
    ],
)
def test_human_size_uses_decimal_units(n, text):
    assert d.human_size(n) == text


@pytest.mark.parametrize(
    "n, text",
    [
        (30_532_122_624, "30.5B"),
        (8_000_000_000, "8B"),
        (600_000_000, "600M"),
        (1500, "1.5K"),
        (12, "12"),
    ],
)
def test_human_number(n, text):
    assert d.human_number(n) == text


@pytest.mark.parametrize(
    "ns, text",
    [
        (0, "0s"),
        (1, "1ns"),
        (999, "999ns"),
        (1_500, "1.5µs"),
        (12_500_000, "12.5ms"),
        (107_234_000, "107.234ms"),
        (1_234_567_000, "1.234567s"),
        (1_000_000_000, "1s"),
        (61_500_000_000, "1m1.5s"),
        (3_600_000_000_000, "1h0m0s"),
        (3_723_000_000_000, "1h2m3s"),
        (-2_000_000, "-2ms"),
    ],
)
def test_go_duration_matches_go_formatting(ns, text):
    assert d.go_duration(ns) == text


@pytest.mark.parametrize(
    "seconds, text",
    [
        (0.3, "Less than a second"),
        (1, "1 second"),
        (45, "45 seconds"),
        (90, "About a minute"),
        (150, "2 minutes"),
        (3700, "About an hour"),
        (5 * 3600, "5 hours"),
        (3 * 86400, "3 days"),
        (21 * 86400, "3 weeks"),
        (90 * 86400, "3 months"),
        (800 * 86400, "2 years"),
    ],
)
def test_human_span(seconds, text):
    assert d.human_span(seconds) == text


def test_relative_time_past_and_future():
    assert d.relative_time(NOW - timedelta(minutes=2, seconds=5), NOW) == "2 minutes ago"
    assert d.relative_time(NOW + timedelta(minutes=4, seconds=30), NOW) == "4 minutes from now"


def test_until_column():
    soon = (NOW + timedelta(minutes=4, seconds=59)).isoformat()
    assert d.until(soon, NOW) == "4 minutes from now"
    assert d.until("2318-08-30T12:00:00.123456789Z", NOW) == "Forever"
    assert d.until((NOW - timedelta(seconds=1)).isoformat(), NOW) == "Stopping..."
    assert d.until("0001-01-01T00:00:00Z", NOW) == "Never"
    assert d.until(None, NOW) == "Never"


@pytest.mark.parametrize(
    "size, vram, text",
    [
        (100, 0, "100% CPU"),
        (100, 100, "100% GPU"),
        (100, 52, "48%/52% CPU/GPU"),
        (0, 0, "100% CPU"),
    ],
)
def test_processor(size, vram, text):
    assert d.processor(size, vram) == text


def test_table_aligns_columns_with_four_spaces():
    out = d.table(
        ("NAME", "ID", "SIZE"), [("demo:latest", "0123456789ab", "1.2 GB"), ("x:1", "ab", "5 B")]
    )
    assert out.splitlines() == [
        "NAME           ID              SIZE",
        "demo:latest    0123456789ab    1.2 GB",
        "x:1            ab              5 B",
    ]


def test_table_pads_by_display_width():
    out = d.table(("A", "B"), [("模型", "x"), ("ab", "y")])
    row1, row2 = out.splitlines()[1:]
    # The wide name takes 4 columns, so both second cells start at column 4 + gap.
    assert d.text_width(row1[: row1.index("x")]) == d.text_width(row2[: row2.index("y")]) == 8


def test_stats_block_labels_and_values():
    block = d.stats_block(
        {
            "total_duration": 1_234_567_000,
            "load_duration": 12_500_000,
            "prompt_eval_count": 26,
            "prompt_eval_duration": 130_000_000,
            "eval_count": 290,
            "eval_duration": 3_650_000_000,
        }
    )
    assert block.splitlines() == [
        "total duration:       1.234567s",
        "load duration:        12.5ms",
        "prompt eval count:    26 token(s)",
        "prompt eval duration: 130ms",
        "prompt eval rate:     200.00 tokens/s",
        "eval count:           290 token(s)",
        "eval duration:        3.65s",
        "eval rate:            79.45 tokens/s",
    ]


def test_stats_block_survives_missing_metrics():
    block = d.stats_block({})
    assert "eval rate:            0.00 tokens/s" in block
    assert block.count("\n") == 8
