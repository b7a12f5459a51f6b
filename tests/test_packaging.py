"""What a built wheel and sdist hold: the wheel every runtime file and nothing else, the sdist the whole source (its
tests run from an unpacked sdist as from a clone)."""

from __future__ import annotations

import shutil
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]
#: Top-level entries of a clone that are not source (git, the README's .venv, build outputs, local runs).
NOT_SOURCE = {".git", ".venv", "build", "dist", "runs", ".whl", ".gl", ".pytest_cache", "shared"}
#: What the sdist must hold beside the package: the build's inputs and everything the tests read.
SDIST_FOLDERS = ("tests", "examples", "benchmarks", "model_cards")


def _ignore(folder: str, names: list[str]) -> set[str]:
    top = Path(folder).resolve() == REPO_ROOT
    return {name for name in names if (top and name in NOT_SOURCE) or name == "__pycache__" or name.endswith(
        (".pyc", ".egg-info"))}


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """(source copy, wheel's file names, sdist's file names relative to its root folder, the wheel's METADATA and
    entry_points.txt), built from a copy of the clone so that the build's `build/` and `*.egg-info` do not land in
    it."""
    pytest.importorskip("setuptools")
    root = tmp_path_factory.mktemp("packaging")
    source, out = root / "source", root / "dist"
    shutil.copytree(REPO_ROOT, source, ignore=_ignore)
    build = ("import sys; from setuptools import build_meta as b; out = sys.argv[1]; "  # (the build rewrites argv)
             "print('built', b.build_wheel(out), b.build_sdist(out))")
    result = subprocess.run([sys.executable, "-c", build, str(out)], cwd=source, capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    wheel_name, sdist_name = result.stdout.strip().splitlines()[-1].split()[1:]  # (setuptools prints its steps)
    with zipfile.ZipFile(out / wheel_name) as wheel:
        wheel_files = set(wheel.namelist())
        info = wheel_name.split("-py")[0] + ".dist-info"
        metadata, entry_points = (wheel.read(f"{info}/{name}").decode() for name in ("METADATA", "entry_points.txt"))
    with tarfile.open(out / sdist_name) as sdist:
        sdist_files = {name.partition("/")[2] for name in sdist.getnames()
                       if sdist.getmember(name).isfile()}
    return source, wheel_files, sdist_files, metadata, entry_points


def test_wheel_holds_every_runtime_file_and_nothing_else(built):
    source, wheel_files, *_ = built
    package = {path.relative_to(source).as_posix() for path in (source / "longreach").rglob("*")
               if path.is_file() and "__pycache__" not in path.parts}
    assert {"longreach/py.typed", "longreach/__main__.py", "longreach/model_card_templates/locost.md"} <= package
    code = {name for name in wheel_files if not name.startswith("longreach-")}
    assert code == package
    metadata = {name.split("/", 1)[1] for name in wheel_files if ".dist-info/" in name}
    assert {"METADATA", "entry_points.txt", "licenses/LICENSE"} <= metadata


def test_sdist_holds_the_whole_source(built):
    """The sdist held the test files named test_*.py but not conftest.py, the helpers they import or the fixtures:
    27 of the 41 test files failed to import from an unpacked sdist; LICENSE, examples/ and benchmarks/ were missing."""
    source, _, sdist_files, *_ = built
    needed = {"pyproject.toml", "README.md", "LICENSE", "MANIFEST.in"}
    for folder in ("longreach", *SDIST_FOLDERS):
        needed |= {path.relative_to(source).as_posix() for path in (source / folder).rglob("*")
                   if path.is_file() and "__pycache__" not in path.parts}
    assert {"tests/conftest.py", "tests/workflow_helpers.py", "tests/fixtures/locost/refs.safetensors"} <= needed
    assert sorted(needed - sdist_files) == []


def test_wheel_metadata(built):
    """Dependencies have lower bounds only (`transformers<6` would refuse the next major release however it works),
    the extras the README installs exist, and the command is the console script."""
    import re

    *_, metadata, entry_points = built
    fields = [line.split(": ", 1) for line in metadata.split("\n\n")[0].splitlines() if ": " in line]
    requirements = [value for key, value in fields if key == "Requires-Dist"]
    assert requirements and [r for r in requirements if re.search(r"<|==|~=|!=", r.split(";")[0])] == []
    assert any(r.startswith("transformers>=") for r in requirements)
    readme = (REPO_ROOT / "README.md").read_text(encoding="utf-8")
    extras = set(re.findall(r"longreach\[(\w+)\]|\.\[(\w+)\]", readme))
    assert {"train", "test"} <= {name for pair in extras for name in pair if name} <= {
        value for key, value in fields if key == "Provides-Extra"}
    assert ("Requires-Python", ">=3.11") in [tuple(f) for f in fields]
    assert ("License-Expression", "Apache-2.0") in [tuple(f) for f in fields]
    assert "longreach = longreach.cli:main" in entry_points
