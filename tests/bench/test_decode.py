"""attnlab.bench.decode's rows: the floor is the larger of the memory and compute terms
(max(bytes / bandwidth, flops / matmul rate)), and which one binds is named."""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from attnlab.bench.decode import CacheRow, DecodeReport, DecodeRow

seconds = st.floats(min_value=1e-7, max_value=10.0)


@given(cached=seconds, memory=seconds, compute=seconds)
def test_a_cache_rows_floor_is_the_larger_term(cached, memory, compute):
    row = CacheRow("multi-query", 1, 512, cached, 3e10, memory, compute, 1.8e11, batch=8)
    assert row.floor_s == max(memory, compute)
    assert row.binds == ("memory" if memory >= compute else "compute")
    assert row.over_floor == pytest.approx(cached / max(memory, compute))


@given(cached=seconds, memory=seconds, compute=seconds)
def test_a_context_rows_floor_is_the_larger_term(cached, memory, compute):
    row = DecodeRow(256, cached, 1.0, 3e10, memory, compute, 1.8e11)
    assert row.floor_s == max(memory, compute)
    assert row.over_floor == pytest.approx(cached / max(memory, compute))


def test_the_json_holds_both_terms_the_floor_and_what_binds():
    report = DecodeReport(768, 12, 12, "float32", 2, 1000)
    report.rows.append(DecodeRow(256, 2.0, 9.0, 3e10, 1.0, 1.5, 1.8e11))
    report.cache_rows.append(CacheRow("multi-head", 12, 6144, 3.0, 3e10, 2.0, 0.5, 1.8e11))
    raw = report.to_dict()
    assert raw["rows"][0]["floor_s"] == 1.5 and raw["rows"][0]["over_floor"] == pytest.approx(
        2 / 1.5
    )
    cache = raw["cache_rows"][0]
    assert (cache["memory_floor_s"], cache["compute_floor_s"], cache["floor_s"]) == (2.0, 0.5, 2.0)
    assert cache["binds"] == "memory" and cache["over_floor"] == pytest.approx(1.5)
