"""One version: pyproject.toml's [project] version is the source; lowbit.__version__, the native build info
and the installed distribution's metadata all agree with it."""

from __future__ import annotations

import importlib.metadata
import pathlib
import re

import pytest

import lowbit
from lowbit import _C

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    tomllib = pytest.importorskip("tomli")

PYPROJECT = pathlib.Path(__file__).resolve().parents[1] / "pyproject.toml"


def _pyproject_version() -> str:
    return tomllib.loads(PYPROJECT.read_text())["project"]["version"]


def test_native_build_and_package_report_pyprojects_version():
    want = _pyproject_version()
    assert _C.build_info()["version"] == want
    assert lowbit.__version__ == want


def test_installed_metadata_agrees():
    try:
        installed = importlib.metadata.version("lowbit")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("lowbit is imported from a source tree that was never installed")
    assert installed == _pyproject_version()


def test_cmake_reads_the_version_line_it_documents():
    # CMakeLists.txt reads the first line matching this pattern when scikit-build-core does not pass the version;
    # it must be the [project] table's, and the only one.
    lines = re.findall(r'^version = "([^"]+)"$', PYPROJECT.read_text(), flags=re.MULTILINE)
    assert lines == [_pyproject_version()]


def test_changelog_has_an_entry_for_this_version():
    changelog = (PYPROJECT.parent / "CHANGELOG.md").read_text()
    assert re.search(rf"^## \[{re.escape(_pyproject_version())}\] - \d{{4}}-\d{{2}}-\d{{2}}$", changelog, re.MULTILINE)
