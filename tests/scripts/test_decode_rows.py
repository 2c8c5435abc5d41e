"""scripts/decode_rows.py measures the bench's own layout rows one at a time, in the order
asked for, each with both floor terms; checked on a tiny stack (the figures themselves are
the bench's, tested in tests/bench)."""

from __future__ import annotations

import pytest
import torch

from tests.scripts import script


@pytest.fixture(scope="module")
def rows_script():
    with script("decode_rows") as module:
        yield module


def test_the_rows_come_in_the_order_asked_each_context_longest_first(rows_script):
    asked = rows_script.parse_rows("1:2:int8,2:1:float32,1:1:bfloat16")
    tiny = {"d_model": 32, "num_heads": 4, "layers": 2, "min_run_time": 0.001, "rounds": 1}
    got = list(rows_script.measure(asked, [8, 24], read_bytes=1 << 20, **tiny))
    described = [(r.num_kv_heads, r.batch, r.cache_dtype, r.context) for r in got]
    assert described == [
        (1, 2, "int8", 24),
        (1, 2, "int8", 8),
        (2, 1, "float32", 24),
        (2, 1, "float32", 8),
        (1, 1, "bfloat16", 24),
        (1, 1, "bfloat16", 8),
    ]
    for row in got:
        floor = max(row.memory_floor_s, row.compute_floor_s)
        assert row.cached_s > 0 and row.over_floor == pytest.approx(row.cached_s / floor)
        line = rows_script.describe(row)
        assert f"context {row.context}:" in line and f"x floor {row.over_floor:.2f}" in line


def test_the_default_rows_parse(rows_script):
    rows = rows_script.parse_rows(rows_script.DEFAULT_ROWS)
    assert rows[:2] == [(1, 8, torch.float32), (1, 1, torch.int8)] and len(rows) == 8


def test_an_unknown_cache_dtype_is_named(rows_script):
    with pytest.raises(SystemExit, match="'float16' is not one of"):
        rows_script.parse_rows("1:1:float16")
