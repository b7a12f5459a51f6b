"""Distributed data-parallel training: `torchrun --nproc_per_node=2` (gloo, CPU) with `Trainer` gives the loss curve of
one process with the same global batch, and the saved checkpoint reloads with the trained weights.

Tolerance: 1e-5 relative on every logged loss. The two runs compute the same mean loss over the same examples, but
the gradient is reduced across processes (an all-reduce of two float32 partial means) instead of in one backward, so
float rounding differs in the last bits; after 4 steps at learning rate 5e-3 that stays below 1e-6 here.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

SCRIPT = Path(__file__).parent / "distributed_training_script.py"
REPO = Path(__file__).resolve().parents[1]


def descendants(pid: int) -> list[int]:
    """Process ids of the children of `pid`, their children and so on (Linux /proc), deepest first."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:  # the process ended while we looked
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    return descendants_of(pid, children)


def descendants_of(pid: int, children: dict[int, list[int]]) -> list[int]:
    return [grandchild for child in children.get(pid, []) for grandchild in [*descendants_of(child, children), child]]


def signal_quietly(pid: int, signum: int) -> None:
    try:
        os.kill(pid, signum)
    except ProcessLookupError:
        pass


def train(kind: str, output_dir: Path, processes: int) -> list[float]:
    scratch = output_dir.parent / f"{output_dir.name}-tmp"  # torchrun's scratch folders, not in /tmp
    scratch.mkdir(parents=True, exist_ok=True)
    environment = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": "", "TMPDIR": str(scratch)}
    per_device = 4 // processes  # global batch 4 either way
    if processes == 1:
        command = [sys.executable, str(SCRIPT), kind, str(output_dir), str(per_device)]
    else:
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={processes}",
                   str(SCRIPT), kind, str(output_dir), str(per_device)]
    # PYTHONFAULTHANDLER: on SIGABRT every Python process of the run (torchrun's agent and its workers) writes the
    # stacks of all its threads to stderr, so a hang shows where it is instead of only that it happened
    environment["PYTHONFAULTHANDLER"] = "1"
    process = subprocess.Popen(command, cwd=REPO, env=environment, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               text=True)
    try:
        stdout, stderr = process.communicate(timeout=300)
    except subprocess.TimeoutExpired:
        # torchrun starts its workers in sessions of their own, so they are signalled one by one, workers first (the
        # list is taken once: a worker whose agent has died is no longer its descendant)
        pids = [*descendants(process.pid), process.pid]
        for pid in pids:
            signal_quietly(pid, signal.SIGABRT)
        try:
            stdout, stderr = process.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            for pid in pids:
                signal_quietly(pid, signal.SIGKILL)
            stdout, stderr = process.communicate()
        pytest.fail(f"{' '.join(command[1:])} did not finish in 300 s; stacks of its processes:\n{stderr[-12000:]}")
    assert process.returncode == 0, stderr[-4000:]
    return json.loads((output_dir / "losses.json").read_text())


@pytest.mark.parametrize("kind", ["locost", "dodo"])
def test_two_processes_match_one_with_the_same_global_batch(kind, tmp_path):
    single = train(kind, tmp_path / "one", processes=1)
    double = train(kind, tmp_path / "two", processes=2)
    assert len(single) == len(double) == 4 and single[0] != single[-1]  # it trained
    print(f"{kind}: losses of 1 process {single}, of 2 processes {double}")
    assert double == pytest.approx(single, rel=1e-5)

    from transformers import AutoModel

    import longreach  # noqa: F401

    reloaded = AutoModel.from_pretrained(tmp_path / "two" / "final")
    saved = load_file(str(tmp_path / "two" / "final" / "model.safetensors"))
    state = reloaded.state_dict()
    for key, tensor in saved.items():
        assert torch.equal(state[key], tensor), key
    one = load_file(str(tmp_path / "one" / "final" / "model.safetensors"))
    assert max((one[key] - tensor).abs().max().item() for key, tensor in saved.items()) < 1e-4
