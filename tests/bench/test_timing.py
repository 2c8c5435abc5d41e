"""attnlab.bench.timing: cold candidates are flushed before every timed call, and the
last-level cache size is read as Linux writes it. No timing figure is asserted."""

import pytest

from attnlab.bench import timing


def test_a_cold_candidate_is_flushed_before_each_call_and_a_warm_one_never():
    events = []
    timing.interleaved_medians(
        {"cold": lambda: events.append("cold"), "warm": lambda: events.append("warm")},
        rounds=2,
        min_run_time=0.0,
        cold={"cold"},
        flush=lambda: events.append("flush"),
    )
    cold_calls = [i for i, event in enumerate(events) if event == "cold"]
    timed = cold_calls[1:]  # the first is the warm-up call
    assert len(timed) >= 2 * 3  # three calls a round at least
    assert all(events[i - 1] == "flush" for i in timed)
    assert events.count("flush") == len(timed)


@pytest.mark.parametrize(
    ("written", "expected"),
    [("491520K", 491520 * 2**10), ("32M", 32 * 2**20), ("1G", 2**30), ("4096", 4096)],
)
def test_the_last_level_cache_is_the_largest_size_linux_reports(
    written, expected, tmp_path, monkeypatch
):
    for index, size in enumerate(["48K", written, "2048K"]):
        folder = tmp_path / f"index{index}"
        folder.mkdir()
        (folder / "size").write_text(size + "\n")
    monkeypatch.setattr(timing, "_CACHES", tmp_path)
    assert timing.last_level_cache_bytes() == max(expected, 2048 * 2**10)
    assert timing.read_bytes() == max(256 * 2**20, 2 * max(expected, 2048 * 2**10))


def test_without_sysfs_the_read_is_256_mib(tmp_path, monkeypatch):
    monkeypatch.setattr(timing, "_CACHES", tmp_path / "absent")
    assert timing.last_level_cache_bytes() == 0
    assert timing.read_bytes() == 256 * 2**20


def test_the_device_copy_moves_each_byte_in_and_out():
    copy, moved = timing.device_copy("cpu", 2**20)
    target = copy()
    assert moved == 2 * 2**20
    assert target.nbytes == 2**20 and bool((target == 1).all())


def test_the_probe_reads_on_the_cpu_and_copies_on_a_device():
    read, read_bytes = timing.bandwidth_probe("cpu", 2**20)
    assert read_bytes == 2**20 and float(read()) == 2**20 / 4  # a sum of ones
    copy, moved = timing.bandwidth_probe("meta", 2**20)  # any device but the CPU's
    assert moved == 2 * 2**20 and copy().device.type == "meta"
