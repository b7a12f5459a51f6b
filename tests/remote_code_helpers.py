"""Run Python code in a fresh process in which ``import longreach`` fails.

This is how a Hub user without longreach installed loads our checkpoints: only transformers (and peft for Dodo) and
the code files saved next to ``config.json``, through ``trust_remote_code=True``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

_BLOCKER = textwrap.dedent(
    """
    import importlib.abc, sys
    class _BlockLongreach(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name == "longreach" or name.startswith("longreach."):
                raise ImportError("longreach is deliberately not importable in this process")
            return None
    sys.meta_path.insert(0, _BlockLongreach())
    try:
        import longreach  # noqa: F401
    except ImportError:
        pass
    else:
        raise SystemExit("longreach was importable: the isolation failed")
    """
)


def run_without_longreach(code: str, workdir: str | os.PathLike, timeout: int = 300) -> dict:
    """Run ``code`` (which must print one JSON object as its last stdout line) and return that object."""
    workdir = Path(workdir)
    script = workdir / "remote_check.py"
    script.write_text(_BLOCKER + "\n" + textwrap.dedent(code), encoding="utf-8")
    env = {key: value for key, value in os.environ.items() if key not in ("PYTHONPATH",)}
    env.update(HF_HUB_OFFLINE="1", HF_MODULES_CACHE=str(workdir / "hf_modules"), TRANSFORMERS_VERBOSITY="error",
               TOKENIZERS_PARALLELISM="false")
    result = subprocess.run(
        [sys.executable, str(script)], cwd=workdir, env=env, capture_output=True, text=True, timeout=timeout
    )
    if result.returncode != 0:
        raise AssertionError(f"fresh process failed ({result.returncode}):\n{result.stdout}\n{result.stderr}")
    return json.loads(result.stdout.strip().splitlines()[-1])
