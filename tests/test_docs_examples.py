"""The README's Quickstart and the ``>>>`` examples of the docstrings run as a user would copy them.

(The README's Guides are run by ``tests/test_readme.py``, the model cards' usage code by ``tests/test_hub.py`` and
``tests/test_workflows_vcc_t5_dodo.py``.) Docstring examples that import what they use run as written; a Hub id
("path/or/repo") becomes a tiny local LOCOST and ``long_document`` a short document. Fragments that continue a
user's own code (no import line: ``prepare_vip_inputs(tokenizer, ...)``, ``VCCT5DataCollator(...)``) are left out.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from workflow_helpers import document, save_tiny_locost

REPO_ROOT = Path(__file__).resolve().parents[1]


def docstring_examples() -> list:
    """A ``pytest.param(file, code)`` for every docstring example that imports what it uses, without the ``>>>`` /
    ``...`` prompts."""
    examples = []
    for path in sorted((REPO_ROOT / "longreach").rglob("*.py")):
        for block in re.findall(r"```python\n(.*?)```", path.read_text(encoding="utf-8"), flags=re.S):
            lines = [line.strip()[4:] for line in block.splitlines() if line.strip().startswith((">>> ", "... "))]
            if any(line.startswith(("import ", "from ")) for line in lines):
                examples.append(pytest.param(str(path.relative_to(REPO_ROOT)), "\n".join(lines), id=path.stem))
    return examples


def test_quickstart_runs():
    text = (REPO_ROOT / "README.md").read_text(encoding="utf-8")
    code = re.search(r"\n## Quickstart\n.*?```python\n(.*?)```", text, flags=re.S).group(1)
    namespace: dict = {}
    exec(compile(code, "README.md", "exec"), namespace)  # noqa: S102 - our own documentation
    assert tuple(namespace["document"].shape) == (1, 20_000)
    assert namespace["summary_ids"].shape[0] == 1 and 2 <= namespace["summary_ids"].shape[1] <= 17  # start + 16 new


def test_docstring_examples_are_found():
    files = {example.values[0] for example in docstring_examples()}
    assert {"longreach/configuration/configuration_locost.py", "longreach/modeling/modeling_dodo.py",
            "longreach/modeling/modeling_vcc_t5.py", "longreach/pipelines/pipeline_summarization.py"} <= files


@pytest.mark.parametrize(("path", "code"), docstring_examples())
def test_docstring_example_runs(path, code, isolated_hf_env):
    folder = save_tiny_locost(isolated_hf_env / "tiny-locost")
    code = code.replace('"path/or/repo"', repr(str(folder)))
    namespace: dict = {"long_document": document(300)}
    exec(compile(code, path, "exec"), namespace)  # noqa: S102 - our own documentation
    if "summarizer" in namespace:
        assert isinstance(namespace["summarizer"](namespace["long_document"], max_new_tokens=4)[0]["summary_text"], str)
