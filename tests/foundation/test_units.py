"""One reading and one writing of byte sizes and durations for every front-end."""

from __future__ import annotations

import pytest

from exl3local import units


@pytest.mark.parametrize(("n", "text"), [
    (0, "0 B"), (1023, "1023 B"), (1024, "1.0 KiB"), (1536, "1.5 KiB"), (5 * 2**20, "5.0 MiB"),
    (3 * 2**30 + 2**29, "3.5 GiB"), (2 * 2**40, "2.0 TiB"), (-2048, "-2.0 KiB"),
])
def test_bytes_are_written_in_binary_units(n, text):
    assert units.format_bytes(n) == text


def test_an_unknown_size_or_duration_reads_as_the_callers_mark():
    assert units.format_bytes(None) == "-" and units.format_bytes(None, none="–") == "–"
    assert units.format_duration(None) == "-" and units.format_duration(None, none="–") == "–"


@pytest.mark.parametrize(("s", "text"), [(0, "0s"), (59.9, "59s"), (60, "1m00s"), (125, "2m05s"),
                                         (3599, "59m59s"), (3600, "1h00m"), (7300, "2h01m")])
def test_durations_keep_two_units(s, text):
    assert units.format_duration(s) == text


def test_gib_lines_keep_one_unit_with_two_decimals():
    assert units.format_gib(3 * 2**30 // 2) == "1.50 GiB" and units.format_gib(0) == "0.00 GiB"


def test_a_written_size_reads_back():
    for n in (2**30, 3 * 2**29, 512 * 2**20):
        value, unit = units.format_bytes(n).split()
        assert units.parse_size(f"{value}{unit}") == n
