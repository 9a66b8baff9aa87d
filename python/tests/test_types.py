"""The package's types, as an editor sees them: mypy finds no error in the package (its
annotations and the stubs of the native module, ``_native.pyi``), and stubtest finds the stubs
to be the native module's (every name, every signature)."""

import pathlib
import subprocess
import sys

import pytest

pytest.importorskip("mypy", reason="mypy is in the package's test extra (pip install "
                    "'./python[test]')")

ALLOWLIST = pathlib.Path(__file__).with_name("stubtest_allowlist.txt")


def run(args, cwd):
    r = subprocess.run([sys.executable, "-m", *args], cwd=cwd, capture_output=True, text=True,
                       timeout=600)
    return r.returncode, r.stdout + r.stderr


def test_mypy_finds_no_error_in_the_package(tmp_path):
    code, out = run(["mypy", "--cache-dir", str(tmp_path / "cache"), "-p", "kvstore"],
                    tmp_path)
    assert code == 0, out
    assert "Success" in out, out


def test_the_stubs_are_the_native_module_s(tmp_path):
    code, out = run(["mypy.stubtest", "--allowlist", str(ALLOWLIST), "kvstore"], tmp_path)
    assert code == 0, out
