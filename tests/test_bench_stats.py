"""The benchmarks' same-run statistics (benchmarks/common.py): the paired-ratio interval and the verdict a goal
is judged on (docs/benchmarks.md), and the store probe printed next to file:// figures."""

from __future__ import annotations

import math
import re
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from common import durable_unnamed_write, paired_interval, ratio_line, store_probe, verdict  # noqa: E402


def test_interval_is_the_t_interval_of_the_log_ratios():
    # logs: ln 0.9, ln 1.0 -> mean m, s = |ln 0.9| / sqrt(2), n = 2, t(0.975, 1) = 12.706
    gm, lo, hi = paired_interval([0.9, 1.0])
    m, s = math.log(0.9) / 2, abs(math.log(0.9)) / math.sqrt(2)
    assert gm == pytest.approx(math.sqrt(0.9))
    assert lo == pytest.approx(math.exp(m - 12.706 * s / math.sqrt(2)))
    assert hi == pytest.approx(math.exp(m + 12.706 * s / math.sqrt(2)))


def test_interval_narrows_with_rounds_and_is_symmetric_in_logs():
    few = paired_interval([0.9, 1.0, 0.95, 1.05])
    many = paired_interval([0.9, 1.0, 0.95, 1.05] * 10)
    assert many[2] - many[1] < few[2] - few[1]
    gm, lo, hi = many
    assert math.log(gm) - math.log(lo) == pytest.approx(math.log(hi) - math.log(gm))
    assert paired_interval([0.97]) == pytest.approx((0.97, 0.97, 0.97))
    assert paired_interval([1.0] * 8) == pytest.approx((1.0, 1.0, 1.0))


@pytest.mark.parametrize(("low", "high", "target", "want"), [
    (0.951, 0.99, ">= 0.95", "met"), (0.95, 0.99, ">= 0.95", "met"), (0.90, 0.949, ">= 0.95", "not met"),
    (0.93, 0.97, ">= 0.95", "undecided"), (0.93, 0.97, "1.0: no cost when unused", ""), (0.9, 1.0, ">= x", ""),
])
def test_verdict(low, high, target, want):
    assert verdict(low, high, target) == want


def test_ratio_line_prints_the_interval_and_judges_only_with_two_rounds_or_more():
    line = ratio_line("a / b", [96.8, 97.2, 97.0], [100.0, 100.0, 100.0], ">= 0.95")
    assert "geomean 0.970 [95% CI" in line and line.endswith("(target >= 0.95: met)")
    one = ratio_line("a / b", [90.0], [100.0], ">= 0.95")
    assert one.endswith("(target >= 0.95)")
    slower = ratio_line("t", [2.0, 2.0], [1.0, 1.0], ">= 0.95", higher_is_better=False)
    assert "geomean 0.500 [95% CI 0.500, 0.500]" in slower and slower.endswith("not met)")


def test_store_probe_writes_durable_files_in_a_new_subfolder_each_time(tmp_path):
    line = store_probe(tmp_path, files=4, size=100)
    assert re.fullmatch(rf"store probe \(4 files of 100 B in {re.escape(str(tmp_path))}\): create \d+ us CPU / \d+ us "
                        r"wall, write \+ fsync \d+ us CPU / \d+ us wall \(medians\)", line), line
    store_probe(tmp_path, files=2, size=10)
    # left in place for the caller (no deletes of its own), one new subfolder per call, every file whole
    assert sorted(p.name for p in tmp_path.iterdir()) == [".store-probe-0", ".store-probe-1"]
    assert [p.stat().st_size for p in sorted((tmp_path / ".store-probe-0").iterdir())] == [100] * 4
    assert [p.stat().st_size for p in sorted((tmp_path / ".store-probe-1").iterdir())] == [10] * 2


def test_store_probe_raises_for_a_folder_it_cannot_write(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_bytes(b"")
    with pytest.raises(OSError):
        store_probe(blocker / "below")


def test_durable_unnamed_write_links_the_whole_file_create_only(tmp_path):
    import os

    dfd = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        durable_unnamed_write(dfd, "a", b"xyz" * 1000)
        with pytest.raises(FileExistsError):  # create-only: an existing name is never replaced
            durable_unnamed_write(dfd, "a", b"other")
    finally:
        os.close(dfd)
    assert [p.name for p in tmp_path.iterdir()] == ["a"]  # nothing else left (the unnamed file of the refused one)
    assert (tmp_path / "a").read_bytes() == b"xyz" * 1000
