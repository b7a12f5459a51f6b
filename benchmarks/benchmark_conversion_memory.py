"""Peak memory of the converters, as a multiple of the converted model's size.

A converter that holds several copies of a model cannot convert Dodo's 7B Llama (28 GB in float32) on a machine of
64 GB. This script writes synthetic checkpoints in the authors' formats at a chosen size (random values: memory does
not depend on them), runs each converter in a process of its own and reports that process's peak RSS above its RSS
just before the conversion started (after the imports), in bytes and in multiples of the converted weights' size.
Two peaks: the whole RSS (``ru_maxrss``), and its anonymous part (``RssAnon``, read every 5 ms by a thread: a spike
shorter than that can be missed), which leaves out the pages of memory-mapped files (the checkpoints read, the
folder reloaded): those are clean copies of files on disk, which the kernel drops under memory pressure instead of
failing. The anonymous peak is what must fit in memory.

* ``dodo``: the authors' Lightning ``weights.ckpt`` (float32 LoRA adapters, scorer and soft prompt, the format of
  ``tests/fixtures/dodo``) and a base Llama folder in float16 (as Llama-2's Hub weights): the converted model is
  float32 throughout (the widest source dtype), twice the size of the base.
* ``vcc``: a plain transformers T5 folder in float32 with ``--vcc_preset base`` (its 4 segment-local layers, or
  every layer of a T5 with fewer).

Usage::

    python benchmarks/benchmark_conversion_memory.py                        # both, ~270M-parameter models
    python benchmarks/benchmark_conversion_memory.py --routes dodo --hidden_size 2048 --num_layers 8
    python benchmarks/benchmark_conversion_memory.py --json benchmarks/results/conversion_memory.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
FIXTURES = Path(os.environ.get("LONGREACH_FIXTURES") or REPO / "tests" / "fixtures")  # as tests/conftest.py finds them


def random_model(model_class, config):
    """``model_class(config)`` with N(0, 0.02) weights, made without the initialisation's cost (memory does not depend
    on the values)."""
    import torch

    with torch.device("meta"):
        model = model_class(config)
    model.to_empty(device="cpu")
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.normal_(0, 0.02)
    model.tie_weights()
    return model


def write_dodo_source(folder: Path, hidden_size: int, num_layers: int, vocab_size: int, lora_rank: int = 32) -> dict:
    """A base Llama folder (float16) and an authors'-format ``weights.ckpt`` beside it; returns the converter's args."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    heads = max(1, hidden_size // 64)
    config = LlamaConfig(hidden_size=hidden_size, intermediate_size=int(hidden_size * 2.75) // 64 * 64,
                         num_hidden_layers=num_layers, num_attention_heads=heads, num_key_value_heads=heads,
                         vocab_size=vocab_size, tie_word_embeddings=False, dtype="float16")
    base = random_model(LlamaForCausalLM, config)
    base.to(torch.float16).save_pretrained(folder / "base")
    base_parameters = sum(p.numel() for p in base.parameters())
    del base
    # The trainable tensors under the authors' names (tests/fixtures/dodo/dodo_ckpt/weights.ckpt at another size)
    fixture = torch.load(FIXTURES / "dodo" / "dodo_ckpt" / "weights.ckpt", weights_only=True)
    state_dict = {}
    prefix = "nugget.lora_llama.base_model.model.model.layers"
    for layer in range(num_layers):
        for projection in ("q_proj", "v_proj", "o_proj"):
            for role in ("encoder", "decoder"):
                state_dict[f"{prefix}.{layer}.self_attn.{projection}.lora_A.{role}.weight"] = torch.randn(
                    lora_rank, hidden_size) * 0.01
                state_dict[f"{prefix}.{layer}.self_attn.{projection}.lora_B.{role}.weight"] = torch.randn(
                    hidden_size, lora_rank) * 0.01
    state_dict.update({
        "nugget.encoder.scorer.0.weight": torch.randn(hidden_size, hidden_size) * 0.01,
        "nugget.encoder.scorer.0.bias": torch.zeros(hidden_size),
        "nugget.encoder.scorer.2.weight": torch.randn(1, hidden_size) * 0.01,
        "nugget.encoder.scorer.2.bias": torch.zeros(1),
        "nugget.decoder.soft_emb.weight": torch.randn(1, hidden_size) * 0.01,
        "nugget.decoder.soft_emb_tc.weight": torch.randn(1, hidden_size) * 0.01,
    })
    fixture["state_dict"] = state_dict
    fixture["hyper_parameters"] = {**fixture["hyper_parameters"], "pretrained": str(folder / "base"),
                                   "nugget_layer": min(3, num_layers - 1)}
    torch.save(fixture, folder / "weights.ckpt")
    converted_bytes = 4 * (sum(t.numel() for t in state_dict.values()) + base_parameters)
    return {"argv": ["--checkpoint_path", str(folder / "weights.ckpt")], "converted_bytes": converted_bytes,
            "module": "longreach.conversion.convert_dodo_original_checkpoint"}


def write_vcc_source(folder: Path, hidden_size: int, num_layers: int, vocab_size: int) -> dict:
    """A plain transformers T5 folder in float32; returns the converter's args."""
    import torch
    from transformers import T5Config, T5ForConditionalGeneration

    config = T5Config(d_model=hidden_size, d_ff=4 * hidden_size, d_kv=64, num_heads=max(1, hidden_size // 64),
                      num_layers=num_layers, num_decoder_layers=num_layers, vocab_size=vocab_size)
    model = random_model(T5ForConditionalGeneration, config)
    model.save_pretrained(folder / "t5")
    converted_bytes = 4 * sum(p.numel() for p in model.parameters())
    del model
    return {"argv": ["--checkpoint_path", str(folder / "t5"), "--vcc_preset", "base",
                     "--num_vanilla_layers", str(min(4, num_layers))],  # the preset's 4, or every layer of a tiny T5
            "converted_bytes": converted_bytes, "module": "longreach.conversion.convert_vcc_original_checkpoint"}


#: Run in the measured process: imports first, then the RSS before the conversion, then the conversion.
CHILD = textwrap.dedent("""
    import importlib, json, resource, sys, threading, time
    module = importlib.import_module(sys.argv[1])
    def status():
        with open("/proc/self/status") as lines:
            return {line.split(":")[0]: int(line.split()[1]) * 1024 for line in lines if line.startswith("Rss")
                    or line.startswith("VmRSS")}
    before = status()
    peak_anonymous = [before["RssAnon"]]
    def sample():
        while True:
            peak_anonymous[0] = max(peak_anonymous[0], status()["RssAnon"])
            time.sleep(0.005)
    threading.Thread(target=sample, daemon=True).start()
    code = module.main(sys.argv[2:])
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    print("RESULT " + json.dumps({"code": code, "rss_before": before["VmRSS"], "peak_rss": peak,
                                  "anonymous_before": before["RssAnon"], "peak_anonymous": peak_anonymous[0]}))
""")


def measure(route: str, hidden_size: int, num_layers: int, vocab_size: int, work: Path) -> dict:
    source = work / f"{route}-source"
    source.mkdir()
    writer = write_dodo_source if route == "dodo" else write_vcc_source
    spec = writer(source, hidden_size, num_layers, vocab_size)
    output = work / f"{route}-converted"
    command = [sys.executable, "-c", CHILD, spec["module"], *spec["argv"], "--pytorch_dump_folder_path", str(output)]
    result = subprocess.run(command, capture_output=True, text=True, env={**os.environ, "TOKENIZERS_PARALLELISM": "0"})
    line = next((line for line in result.stdout.splitlines() if line.startswith("RESULT ")), None)
    if result.returncode != 0 or line is None or json.loads(line[len("RESULT "):])["code"] != 0:
        raise RuntimeError(f"{route} conversion failed:\n{result.stdout[-2000:]}\n{result.stderr[-4000:]}")
    measured = json.loads(line[len("RESULT "):])
    above = measured["peak_rss"] - measured["rss_before"]
    anonymous_above = measured["peak_anonymous"] - measured["anonymous_before"]
    return {"route": route, "hidden_size": hidden_size, "num_layers": num_layers, "vocab_size": vocab_size,
            "converted_bytes": spec["converted_bytes"], **measured, "peak_above_start": above,
            "model_copies": round(above / spec["converted_bytes"], 2), "anonymous_above_start": anonymous_above,
            "anonymous_model_copies": round(anonymous_above / spec["converted_bytes"], 2)}


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--routes", nargs="+", choices=["dodo", "vcc"], default=["dodo", "vcc"])
    parser.add_argument("--hidden_size", type=int, default=1024, help="d_model / hidden_size (default 1024).")
    parser.add_argument("--num_layers", type=int, default=16, help="Layers (per stack for T5; default 16).")
    parser.add_argument("--vocab_size", type=int, default=32000)
    parser.add_argument("--json", type=Path, help="Also write the rows to this JSON file.")
    args = parser.parse_args(argv)
    for name in ("hidden_size", "num_layers", "vocab_size"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} {getattr(args, name)}: expected a positive integer.")
    if args.hidden_size % 64:
        parser.error(f"--hidden_size {args.hidden_size}: expected a multiple of 64 (heads of 64).")
    return args


def main(argv=None) -> list[dict]:
    args = parse_args(argv)
    rows = []
    with tempfile.TemporaryDirectory(prefix="conversion-memory-") as work:
        for route in args.routes:
            row = measure(route, args.hidden_size, args.num_layers, args.vocab_size, Path(work))
            rows.append(row)
            print(f"{route}: converted weights {row['converted_bytes'] / 2**20:,.0f} MiB; peak RSS "
                  f"{row['peak_rss'] / 2**20:,.0f} MiB, {row['peak_above_start'] / 2**20:,.0f} MiB above the start "
                  f"({row['model_copies']} copies of the converted weights); anonymous memory "
                  f"{row['anonymous_above_start'] / 2**20:,.0f} MiB above the start "
                  f"({row['anonymous_model_copies']} copies)", flush=True)
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        temporary = args.json.with_name(f".{args.json.name}.tmp-{os.getpid()}")
        temporary.write_text(json.dumps(rows, indent=2) + "\n")
        os.replace(temporary, args.json)
    return rows


if __name__ == "__main__":
    main()
