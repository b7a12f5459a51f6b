"""Shared pytest fixtures.

The parity fixtures written by the authors' original code ship inside the repository, in ``tests/fixtures``
(a copy of the steering project's ``shared/fixtures``, about 10 MB), so a fresh clone runs every parity test.
Their absence is an error, never a skip: a parity test that does not run proves nothing.
``LONGREACH_FIXTURES`` points elsewhere (it is looked at first).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))  # test helpers (t5_reference, ...) import by name


def locate_fixtures() -> Path:
    candidates = []
    if os.environ.get("LONGREACH_FIXTURES"):
        candidates.append(Path(os.environ["LONGREACH_FIXTURES"]))
    candidates += [REPO_ROOT / "tests" / "fixtures", REPO_ROOT / "shared" / "fixtures",
                   REPO_ROOT.parent / "shared" / "fixtures"]
    for candidate in candidates:
        if (candidate / "locost").is_dir():
            return candidate
    raise FileNotFoundError(
        "Parity fixtures not found (looked in: " + ", ".join(str(c) for c in candidates) + "). "
        "They ship in tests/fixtures: restore that folder from git, or set LONGREACH_FIXTURES."
    )


@pytest.fixture(scope="session")
def fixtures_dir() -> Path:
    return locate_fixtures()


@pytest.fixture(autouse=True)
def _deterministic():
    # every test starts from the same seed and thread count: a test that changes torch's thread count (the
    # benchmark's --threads) must not change the reduction order of the tests after it, some of which compare
    # bit for bit with a subprocess running at the default thread count
    torch.manual_seed(0)
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def isolated_hf_env(tmp_path, monkeypatch):
    """Offline Hub, and remote-code modules cached under a temporary folder."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_MODULES_CACHE", str(tmp_path / "hf_modules"))
    return tmp_path


@pytest.fixture
def recorder(monkeypatch):
    """``longreach.hub`` uploads through a `RecordingHubApi` (offline)."""
    from hub_recorder import RecordingHubApi

    from longreach import hub

    RecordingHubApi.instances = []
    monkeypatch.setattr(hub, "HfApi", RecordingHubApi)
    return RecordingHubApi
