"""The suite's own hooks (tests/conftest.py): file order by marker, one report per failed
shared fixture. Run in a separate pytest process on a folder of its own."""

import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def _pytest(folder: Path, *args: str) -> str:
    shutil.copy(REPO / "tests" / "conftest.py", folder / "conftest.py")
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-p",
            "no:cacheprovider",
            "-p",
            "no:xdist",
            "--rootdir",
            str(folder),
            "-c",
            "/dev/null",
            *args,
            str(folder),
        ],
        capture_output=True,
        text=True,
        cwd=folder,
        timeout=120,
    )
    return proc.stdout + proc.stderr


def test_a_failed_module_fixture_is_reported_once(tmp_path):
    (tmp_path / "test_shared.py").write_text(
        textwrap.dedent("""
        import pytest

        @pytest.fixture(scope="module")
        def expensive():
            raise RuntimeError("the shared run failed: exit 1")

        def test_one(expensive): pass
        def test_two(expensive): pass
        def test_three(expensive): pass
    """)
    )
    out = _pytest(tmp_path, "-q", "-rN")  # no short summary: each report once
    assert "3 errors" in out, out
    assert out.count('raise RuntimeError("the shared run failed') == 1, out
    assert out.count("a shared fixture failed before this test ran, in") == 2, out
    assert "test_shared.py::test_one (its traceback is reported there)" in out


def test_files_run_end_to_end_first_then_integration_then_unit(tmp_path):
    marks = {"a_unit": "", "b_integration": "integration", "c_e2e": "e2e"}
    for name, mark in marks.items():
        head = f"import pytest\npytestmark = pytest.mark.{mark}\n" if mark else ""
        (tmp_path / f"test_{name}.py").write_text(head + "def test_it():\n    pass\n")
    out = _pytest(tmp_path, "-v", "-o", "markers=e2e\nintegration")
    order = [ln.split("::")[0] for ln in out.splitlines() if "::test_it PASSED" in ln]
    assert order == ["test_c_e2e.py", "test_b_integration.py", "test_a_unit.py"], out


def test_the_longest_files_go_first_whatever_their_markers(tmp_path):
    folder = tmp_path / "tests"  # the conftest's LONG_FILES name files under its tests/ folder
    folder.mkdir()
    marks = {"a_unit": "", "c_e2e": "e2e", "learning": "e2e", "stack": ""}
    for name, mark in marks.items():
        head = f"import pytest\npytestmark = pytest.mark.{mark}\n" if mark else ""
        (folder / f"test_{name}.py").write_text(head + "def test_it():\n    pass\n")
    out = _pytest(folder, "-v", "-o", "markers=e2e\nintegration")
    order = [ln.split("::")[0] for ln in out.splitlines() if "::test_it PASSED" in ln]
    assert order == ["test_stack.py", "test_learning.py", "test_c_e2e.py", "test_a_unit.py"], out


def test_cpu_top_lists_the_phases_that_used_most_cpu_children_included(tmp_path):
    (tmp_path / "test_cpu.py").write_text(
        textwrap.dedent("""
        import subprocess, sys

        def test_busy_child():  # the CPU is spent in a child process, waited for
            subprocess.run([sys.executable, "-c", "sum(range(30_000_000))"], check=True)

        def test_idle():
            pass
    """)
    )
    out = _pytest(tmp_path, "-q", "--cpu-top", "2")
    assert "the 2 test phases with the most CPU-seconds" in out, out
    lines = out.splitlines()
    heading = next(i for i, ln in enumerate(lines) if "test phases with the most" in ln)
    first = lines[heading + 1].split()
    assert first[1:] == ["call", "test_cpu.py::test_busy_child"], out
    assert float(first[0].rstrip("s")) > 0.3, out
    assert "the 2 test phases" not in _pytest(tmp_path, "-q"), "off by default"
