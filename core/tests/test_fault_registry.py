"""The fault registry of the kit's pytest plugin: ``@pytest.mark.fault(area, what)``, ``--faults``."""

from __future__ import annotations

import subprocess
import sys
import textwrap


def _collect(tmp_path, body, *args):
    (tmp_path / "test_x.py").write_text(textwrap.dedent(body))
    return subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
                           "--rootdir", str(tmp_path), "-c", "/dev/null", "--faults", *args, str(tmp_path)],
                          capture_output=True, text=True, cwd=tmp_path, timeout=120)


def test_counts_each_case_per_area_and_lists_them(tmp_path):
    p = _collect(tmp_path, """
        import pytest

        @pytest.mark.fault("reader", "bad bytes")
        @pytest.mark.parametrize("b", [b"", b"x", b"yy"], ids=["empty", "one", "two"])
        def test_a(b):
            pass

        @pytest.mark.fault("s3", "refused endpoint")
        def test_b():
            pass

        def test_not_a_fault():
            pass
    """, "--faults-list")
    assert p.returncode == 0, p.stdout + p.stderr
    assert "| reader | 3 |" in p.stdout and "| s3 | 1 |" in p.stdout and "| **total** | **4** |" in p.stdout
    assert "reader: bad bytes [one]  (test_x.py::test_a[one])" in p.stdout
    assert "not_a_fault" not in p.stdout.split("| **total**")[1]


def test_malformed_and_duplicate_markers_are_usage_errors(tmp_path):
    p = _collect(tmp_path, """
        import pytest

        @pytest.mark.fault("reader")
        def test_a():
            pass
    """)
    assert p.returncode == 4 and "needs two non-empty strings" in p.stdout + p.stderr
    p = _collect(tmp_path, """
        import pytest

        @pytest.mark.fault("reader", "same")
        def test_a():
            pass

        @pytest.mark.fault("reader", "same")
        def test_b():
            pass
    """)
    assert p.returncode == 4 and "registered twice" in p.stdout + p.stderr
