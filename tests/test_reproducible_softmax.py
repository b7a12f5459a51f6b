"""``reproducible_softmax``: float32 CPU softmax with the same bits on every CPU (used by VCC-T5, see t5_blocks).

``tests/data/avx512_softmax.safetensors`` holds random scores (with masked and -inf entries, row lengths around the
16-lane boundaries) and ``torch.softmax`` of them on an AVX-512 CPU (torch 2.13.0+cpu,
``torch.backends.cpu.get_cpu_capability() == "AVX512"``), written by ``python tests/test_reproducible_softmax.py
--write`` on such a machine. Every CPU must reproduce those bits.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from longreach.modeling.t5_blocks import last_dim_softmax, reproducible_softmax

REFERENCE = Path(__file__).resolve().parent / "data" / "avx512_softmax.safetensors"
ROW_LENGTHS = (1, 2, 3, 15, 16, 17, 31, 32, 33, 134, 257)


def reference_inputs() -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    inputs = {}
    for length in ROW_LENGTHS:
        scores = torch.randn(16, length, generator=generator) * 8
        scores[0, : length // 2] = torch.finfo(torch.float32).min  # T5's additive mask
        if length > 2:
            scores[1, 1] = float("-inf")
            scores[2, -1] -= 100.0  # an exponential in the subnormal range
        inputs[f"scores_{length}"] = scores
    return inputs


def test_equals_torch_softmax_on_avx512_bit_for_bit_on_every_cpu():
    reference = load_file(str(REFERENCE))
    for length in ROW_LENGTHS:
        scores = reference[f"scores_{length}"]
        assert torch.equal(scores, reference_inputs()[f"scores_{length}"])
        assert torch.equal(reproducible_softmax(scores), reference[f"softmax_{length}"]), f"rows of {length}"


def test_equals_torch_softmax_here_when_this_cpu_is_avx512():
    scores = torch.randn(4, 6, 77, 140) * 5
    if torch.backends.cpu.get_cpu_capability() == "AVX512":
        assert torch.equal(reproducible_softmax(scores), torch.softmax(scores, dim=-1))
    else:  # a different summation order: the last bits only
        torch.testing.assert_close(reproducible_softmax(scores), torch.softmax(scores, dim=-1), rtol=1e-6, atol=1e-7)


def test_gradient_is_softmax_backward():
    scores = (torch.randn(3, 50) * 4).requires_grad_()
    weights = torch.randn(3, 50)
    (ours,) = torch.autograd.grad((reproducible_softmax(scores) * weights).sum(), scores)
    (torchs,) = torch.autograd.grad((torch.softmax(scores, dim=-1) * weights).sum(), scores)
    torch.testing.assert_close(ours, torchs, rtol=1e-6, atol=1e-7)


def test_other_dtypes_and_the_config_switch_use_torch_softmax():
    scores = torch.randn(5, 40, dtype=torch.float64)
    assert torch.equal(reproducible_softmax(scores), torch.softmax(scores, dim=-1))
    scores = torch.randn(5, 40)

    class Config:
        reproducible_softmax = False

    assert torch.equal(last_dim_softmax(scores, Config()), torch.softmax(scores, dim=-1))
    Config.reproducible_softmax = True
    assert torch.equal(last_dim_softmax(scores, Config()), reproducible_softmax(scores))


VCC_DIGEST_SCRIPT = """
import hashlib, sys, torch
from safetensors.torch import load_file
from longreach import VCCT5ForConditionalGeneration
refs = load_file(sys.argv[2])
model = VCCT5ForConditionalGeneration.from_pretrained(sys.argv[1]).eval()
model.set_attn_implementation("eager")
with torch.no_grad():
    out = model.encoder(input_ids=refs["input_ids"], attention_mask=refs["attention_mask"],
                        vip_mask=refs["encoder_input_important_mask"], output_compression_info=True)
info = out.compression_info
digest = hashlib.sha256(out.last_hidden_state.numpy().tobytes())
for layer in range(len(info.compressed_hidden_states)):
    digest.update(info.compressed_hidden_states[layer].numpy().tobytes())
    digest.update(info.selection_scores[layer].numpy().tobytes())
print(torch.backends.cpu.get_cpu_capability(), digest.hexdigest())
"""


def vcc_digest(command: list[str], capability: str | None = None) -> list[str]:
    env = {**os.environ, "ATEN_CPU_CAPABILITY": capability} if capability else None
    return subprocess.run(command, capture_output=True, text=True, check=True, env=env).stdout.split()


@pytest.fixture(scope="module")
def vcc_digest_command(fixtures_dir, tmp_path_factory) -> list[str]:
    from longreach.conversion.convert_vcc_original_checkpoint import convert_vcc_checkpoint

    converted = tmp_path_factory.mktemp("vcc") / "converted"
    convert_vcc_checkpoint(fixtures_dir / "vcc" / "hf_ckpt", converted)
    return [sys.executable, "-c", VCC_DIGEST_SCRIPT, str(converted), str(fixtures_dir / "vcc" / "refs.safetensors")]


@pytest.mark.parametrize("capability", ["avx2", "default"])
def test_vcc_eager_encoder_gives_the_same_bits_with_every_cpu_kernel(vcc_digest_command, capability):
    """ATen picks its CPU kernels once per process (``ATEN_CPU_CAPABILITY`` forces a lower one, never a higher one):
    the VCC-T5 encoder's eager outputs and compression steps must not change with them (with torch's softmax they
    moved by 1.1e-5 between AVX-512 and AVX2)."""
    native = vcc_digest(vcc_digest_command)
    forced = vcc_digest(vcc_digest_command, capability)
    assert forced[0] == capability.upper()
    assert forced[1] == native[1], f"native {native[0]} and {capability} differ"


def _write_reference() -> None:
    if torch.backends.cpu.get_cpu_capability() != "AVX512":
        raise SystemExit("write the reference on an AVX-512 CPU (torch.backends.cpu.get_cpu_capability()).")
    tensors = {}
    for name, scores in reference_inputs().items():
        tensors[name] = scores
        tensors[name.replace("scores", "softmax")] = torch.softmax(scores, dim=-1)
    REFERENCE.parent.mkdir(exist_ok=True)
    save_file(tensors, str(REFERENCE), metadata={"torch": torch.__version__, "capability": "AVX512"})
    print(f"wrote {REFERENCE} ({hashlib.sha256(REFERENCE.read_bytes()).hexdigest()[:12]})")


if __name__ == "__main__" and sys.argv[1:] == ["--write"]:
    _write_reference()
