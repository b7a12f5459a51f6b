"""benchmarks/run_all.py: a tiny --quick run writes its cells, report and plot, and a rerun resumes (asserts no
timings)."""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import time
from pathlib import Path

import pytest
import torch

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
RUN_ALL = BENCHMARKS / "run_all.py"


def load_benchmark(name: str):
    """The script ``benchmarks/NAME.py`` as a module (the scripts are not a package)."""
    spec = importlib.util.spec_from_file_location(name, BENCHMARKS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(autouse=True)
def benchmarks_folder_on_path(monkeypatch):
    """The scripts import their neighbours (``from run_all import ...``), as run from their folder."""
    monkeypatch.syspath_prepend(str(BENCHMARKS))


@pytest.fixture(scope="module")
def run_all():
    return load_benchmark("run_all")


def test_quick_run_writes_cells_report_and_plot_and_resumes(run_all, tmp_path, monkeypatch):
    argv = ["--quick", "--suites", "locost", "--models", "locost", "t5", "--tasks", "encode", "--lengths", "32", "32",
            "--threads", "1", "--out", str(tmp_path)]  # a length given twice is measured once (it was twice)
    # cells in this process (a subprocess per cell costs seconds of imports; the command itself uses them)
    monkeypatch.setattr(run_all, "run_in_subprocess", lambda cell, timeout: run_all.run_cell(cell))
    report = run_all.main(argv)

    cells = [json.loads(line) for line in (tmp_path / "cells.jsonl").read_text().splitlines()]
    assert [(cell["model"], cell["task"], cell["length"]) for cell in cells] == [("locost", "encode", 32),
                                                                                   ("t5", "encode", 32)]
    for cell in cells:
        assert "error" not in cell, cell
        assert cell["seconds"] > 0 and cell["flops"] > 0 and cell["matmul_gflops"] > 0
    assert cells[0]["kernel_seconds"] > 0 and cells[0]["kernel_over_matmul"] > 0
    text = report.read_text()
    assert "| 32 | locost |" in text and "| 32 | t5 |" in text and "kernel / matmul" in text
    # which machine: two "AMD EPYC, 2 CPUs" machines of this project differed in vector width (AVX2, AVX512)
    import torch

    capability = torch.backends.cpu.get_cpu_capability()
    assert all(f"CPUs ({capability});" in cell["machine"] for cell in cells) and f"CPUs ({capability});" in text
    assert (tmp_path / "encode.png").stat().st_size > 0
    assert not list(tmp_path.glob(".*.tmp"))  # the plot was written beside and renamed into place

    def no_new_cells(cell, timeout):
        raise AssertionError(f"finished cell run again: {cell}")

    monkeypatch.setattr(run_all, "run_in_subprocess", no_new_cells)
    run_all.main(argv)
    assert len((tmp_path / "cells.jsonl").read_text().splitlines()) == 2


def test_report_does_not_attribute_unrecorded_cells_to_this_machine(run_all, tmp_path):
    """Cells written before the machine was recorded (the committed results hold such) may come from another machine:
    a report rebuilt here counts them instead of naming this machine for them."""
    committed = Path(__file__).resolve().parents[1] / "benchmarks" / "results" / "cells.jsonl"
    cell = json.loads(committed.read_text().splitlines()[0])  # an encode cell of 2026-11-25, without a machine
    assert "machine" not in cell
    with open(tmp_path / "cells.jsonl", "w") as handle:
        handle.write(json.dumps(cell) + "\n")
        handle.write(json.dumps({**cell, "length": 2048, "machine": "Elsewhere, 4 CPUs (AVX2); torch 2.13.0"}) + "\n")
    run_all.main(["--report_only", "--suites", "locost", "--out", str(tmp_path)])
    header = (tmp_path / "README.md").read_text().split("\n")[2]
    assert header.startswith("Elsewhere, 4 CPUs (AVX2); torch 2.13.0 / 1 cells measured before their machine was "
                             "recorded; device cpu")
    assert run_all.host_description() not in header


def test_bad_lengths_are_refused(run_all, capsys):
    with pytest.raises(SystemExit):
        run_all.parse_args(["--lengths", "0"])
    if not torch.cuda.is_available():  # one line before any cell, not an error cell per cell (or a traceback)
        with pytest.raises(SystemExit):
            run_all.parse_args(["--device", "cuda"])
        assert "--device cuda: this machine has no CUDA device" in capsys.readouterr().err


def test_logn_scaling_benchmark_runs_on_a_demo_model(tmp_path, monkeypatch, capsys):
    """benchmarks/benchmark_logn_scaling.py on the smoke demo's model: the document count, then one JSON line per
    setting with a ROUGE-1 in range (no score is asserted: the smoke model is untrained)."""
    from longreach.cli import main as cli_main

    monkeypatch.chdir(tmp_path)
    assert cli_main(["demo", "--smoke"]) == 0
    capsys.readouterr()
    module = load_benchmark("benchmark_logn_scaling")
    monkeypatch.setattr("sys.argv", ["benchmark_logn_scaling.py", "--model", "longreach-demo", "--documents", "2",
                                     "--min_tokens", "1"])
    module.main()
    lines = [json.loads(line) for line in capsys.readouterr().out.strip().splitlines()]
    assert lines[0]["documents"] == 2 and lines[0]["training_inputs_up_to"] == 128
    settings = [line["setting"] for line in lines[1:]]
    assert settings == ["whole", "cut_to_128", "cut_to_256", "cut_to_512", "whole_cross_attention_first_512",
                        "whole_logn_128", "whole_logn_256", "lead"]
    assert all(0.0 <= line["rouge1"] <= 100.0 for line in lines[1:])


def test_profile_step_tables_where_the_time_goes(tmp_path):
    """benchmarks/profile_step.py on a tiny LOCOST training step: an operator table whose shares add up to the whole,
    the backward pass of our own autograd functions among its rows, and --out appending one section per run."""
    module = load_benchmark("profile_step")
    out = tmp_path / "profiles.md"
    text = module.main(["--quick", "--model", "locost", "--task", "train_ckpt", "--length", "48", "--rows", "1000",
                        "--threads", "1", "--out", str(out)])
    rows = [line for line in text.splitlines() if line.startswith("| `")]
    assert len(rows) > 10
    shares = [float(line.rsplit("|", 2)[1].strip().rstrip("%")) for line in rows]
    assert sum(shares) == pytest.approx(100.0, abs=0.05 * len(shares) + 1e-9)  # each share rounded to 0.1
    assert any("_S4DKernelBackward" in line for line in rows)
    module.main(["--quick", "--model", "t5", "--task", "encode", "--length", "16", "--rows", "3", "--out", str(out)])
    sections = [line for line in out.read_text().splitlines() if line.startswith("### ")]
    assert sections == ["### locost, train_ckpt, 48 tokens, float32, cpu (quick: tiny model)",
                        "### t5, encode, 16 tokens, float32, cpu (quick: tiny model)"]
    assert not list(tmp_path.glob("*.tmp"))
    with pytest.raises(SystemExit):
        module.main(["--length", "0"])


@pytest.mark.parametrize("script", ["run_cuda.sh", "run_cuda_followup.sh", "run_cuda_gaps.sh", "run_cuda_next.sh",
                                    "gpu_phases.sh"])
def test_gpu_scripts_parse(script):
    """The GPU scripts run where device time is short: a syntax error must show here, not there (``SMOKE=1
    benchmarks/run_cuda_gaps.sh OUT`` runs every phase of the last one on the CPU, 71 s: not in the default suite)."""
    import shutil
    import subprocess

    if shutil.which("bash") is None:
        pytest.skip("no bash here")
    path = BENCHMARKS / script
    result = subprocess.run(["bash", "-n", str(path)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr


def test_profile_table_on_cuda_counts_kernel_time_once():
    """On CUDA the table ranks host-side operators by the device time of the kernels they launched; the kernels' own
    events (which carry the same time) are left out, so shares are not halved by double counting."""
    import types

    import torch
    from torch.autograd import DeviceType

    module = load_benchmark("profile_step")

    def event(key, device_type, device_us, count=1):
        return types.SimpleNamespace(key=key, device_type=device_type, count=count, self_device_time_total=device_us,
                                     self_cpu_time_total=5.0)

    events = [event("aten::mm", DeviceType.CPU, 3000.0), event("sm90_gemm_kernel", DeviceType.CUDA, 3000.0),
              event("aten::mul", DeviceType.CPU, 1000.0, count=4), event("elementwise_kernel", DeviceType.CUDA, 1000.0),
              event("aten::view", DeviceType.CPU, 0.0, count=9)]
    lines = module.profile_table(events, torch.device("cuda"), rows=10)
    assert lines[2:] == ["| `aten::mm` | 1 | 3.0 | 75.0% |", "| `aten::mul` | 4 | 1.0 | 25.0% |"]


def test_decode_attention_benchmark_times_every_way_on_the_cpu(capsys):
    module = load_benchmark("benchmark_decode_attention")
    rows = module.main(["--device", "cpu", "--lengths", "64", "--iterations", "2"])
    assert [(row["dtype"], row["length"]) for row in rows] == [("float32", 64), ("bfloat16", 64)]
    for row in rows:
        assert row["eager"] > 0 and row["sdpa"] > 0 and row["sdpa math"] > 0
        assert str(row["sdpa efficient_attention"]).startswith("n/a")  # a CUDA kernel: refused on the CPU
    assert "| float32 | 64 |" in capsys.readouterr().out
    with pytest.raises(ValueError, match="--iterations"):
        module.main(["--device", "cpu", "--iterations", "0"])


def test_static_decode_benchmark_times_each_cache_and_checks_the_tokens(capsys):
    module = load_benchmark("benchmark_static_decode")
    rows = module.main(["--quick", "--backend", "aot_eager", "--models", "locost", "vcc-t5", "--lengths", "32",
                        "--new_tokens", "3", "--repeats", "1"])
    assert [(row["model"], row["cache"]) for row in rows] == [(model, cache) for model in ("locost", "vcc-t5")
                                                              for cache in ("dynamic", "static", "static-compiled")]
    assert all("error" not in row and row["same_tokens"] and row["generate_seconds"] > 0 for row in rows), rows
    assert rows[-1]["compile"] == "aot_eager"
    out = capsys.readouterr().out
    assert "| 32 | locost | static-compiled |" in out and "| 32 | vcc-t5 | static-compiled |" in out
    with pytest.raises(ValueError, match="--new_tokens"):
        module.main(["--quick", "--new_tokens", "1"])


def test_compiled_step_benchmark_times_eager_and_compiled_steps(monkeypatch, capsys):
    module = load_benchmark("benchmark_compiled_step")
    rows = module.main(["--quick", "--backend", "aot_eager", "--models", "locost", "--lengths", "32",
                        "--repeats", "1"])
    assert [(row["model"], row["mode"], row["backend"]) for row in rows] == [("locost", "eager", "eager"),
                                                                             ("locost", "default", "aot_eager")]
    assert all("error" not in row and row["seconds"] > 0 and row["first_step_seconds"] > 0 for row in rows)
    assert "| 32 | locost | default |" in capsys.readouterr().out
    (row,) = module.main(["--quick", "--backend", "aot_eager", "--models", "locost", "--lengths", "32", "--repeats",
                          "1", "--modes", "default", "--scope", "blocks"])
    assert row["scope"] == "blocks" and row["compiled_modules"] == 4  # 2 encoder and 2 decoder blocks, each compiled
    assert "error" not in row and row["seconds"] > 0
    capsys.readouterr()
    (row,) = module.main(["--quick", "--models", "locost", "--lengths", "32", "--repeats", "1", "--modes", "eager",
                          "--profile", "3"])  # one more step, profiled: on the CPU, operator calls stand for kernels
    assert row["profiled_launches"] > 100 and row["profiled_step_seconds"] > 0 and row["profiled_device_ms"] == 0
    table = capsys.readouterr().out.split("locost, 32 tokens, eager: profiled step")[1]
    assert "| operator | calls | self CPU time (ms) | share |" in table and "(the other " in table
    with pytest.raises(ValueError, match="--modes"):
        module.main(["--quick", "--backend", "aot_eager", "--modes", "reduce-overhead"])
    with pytest.raises(ValueError, match="--repeats"):
        module.main(["--quick", "--repeats", "0"])
    from longreach.modeling import t5_blocks

    monkeypatch.setattr(t5_blocks, "FEED_FORWARD_STEP_ELEMENTS", t5_blocks.FEED_FORWARD_STEP_ELEMENTS)  # restored after
    (row,) = module.main(["--quick", "--models", "locost", "--lengths", "32", "--modes", "eager", "--repeats", "1",
                          "--feed_forward_step_elements", "640"])  # the tiny d_ff is 64: 10 positions per step
    assert t5_blocks.FEED_FORWARD_STEP_ELEMENTS == 640 and row["feed_forward_step_elements"] == 640
    assert "error" not in row and row["seconds"] > 0
    monkeypatch.setattr(t5_blocks.T5LayerFF, "_fused_dropout_p", t5_blocks.T5LayerFF._fused_dropout_p)  # restored
    (row,) = module.main(["--quick", "--models", "locost", "--lengths", "32", "--repeats", "1", "--modes", "eager",
                          "--unfused_feed_forward"])  # eager: compiled steps run the modules anyway
    assert row["unfused_feed_forward"] and "error" not in row
    from longreach.modeling import ssm

    monkeypatch.setattr(ssm, "FFT_BLOCK_ELEMENTS", ssm.FFT_BLOCK_ELEMENTS)  # restored after
    assert row["fft_block_elements"] == ssm.FFT_BLOCK_ELEMENTS  # the library's, recorded
    (row,) = module.main(["--quick", "--models", "locost", "--lengths", "32", "--modes", "eager", "--repeats", "1",
                          "--fft_block_elements", str(2**40)])  # all channels in one FFT block
    assert ssm.FFT_BLOCK_ELEMENTS == 2**40 and row["fft_block_elements"] == 2**40 and "error" not in row
    assert "peak_memory_mib" not in row  # the CUDA allocator's peak, on CUDA only
    with pytest.raises(ValueError, match="--fft_block_elements"):
        module.main(["--quick", "--fft_block_elements", "0"])
    import torch
    from transformers import T5Config

    layer = t5_blocks.T5LayerFF(T5Config(d_model=8, d_ff=16, feed_forward_proj="gated-gelu")).train()
    assert layer._fused_dropout_p(torch.zeros(1, 8, requires_grad=True)) is None  # the modules run
    with pytest.raises(ValueError, match="--feed_forward_step_elements"):
        module.main(["--quick", "--feed_forward_step_elements", "0"])


def test_vcc_t5_benchmark_times_generate_of_both_models_with_the_same_weights():
    module = load_benchmark("benchmark_vcc_t5")
    cells = [module.run_cell(model, 2048, threads=1, repeats=1, attention="sdpa", generate_tokens=3)
             for model in ("vcc", "t5")]
    for cell in cells:
        assert cell["generated_tokens"] == 3 and cell["seconds_median"] > 0 and cell["runs"] == 1
    assert cells[0]["compressed_length"] < 2048  # VCC-T5's encoder compressed the input
    assert "| 2048 |" in module.table(cells)
    cell = module.run_cell("vcc", 1024, threads=1, repeats=1, attention="sdpa", dims="base")  # t5-base's dimensions
    assert cell["dims"] == "base" and cell["seconds_median"] > 0  # (the cell checks the output's width, 768)


def test_benchmark_json_holds_the_cells_finished_before_an_interruption(monkeypatch, tmp_path):
    """--json is rewritten after each cell (VCC-T5, LOCOST against its peers) or row (Dodo), so that a run cut short
    (a timeout, Ctrl-C) keeps what it measured."""
    import subprocess

    vcc = load_benchmark("benchmark_vcc_t5")
    finished = {"model": "vcc", "length": 8, "seconds_median": 1.0}

    def one_cell_then_interrupted(model, length, args):
        if length == 16:
            raise KeyboardInterrupt
        return {**finished, "model": model, "length": length}

    monkeypatch.setattr(vcc, "run_in_subprocess", one_cell_then_interrupted)
    monkeypatch.setattr(sys, "argv", ["benchmark_vcc_t5.py", "--vcc_lengths", "8", "16", "--json",
                                      str(tmp_path / "vcc.json")])
    with pytest.raises(KeyboardInterrupt):
        vcc.main()
    (cell,) = json.loads((tmp_path / "vcc.json").read_text())
    assert {name: cell[name] for name in finished} == finished and cell["threads"] == 2  # with its settings

    peers = load_benchmark("benchmark_locost_vs_peers")
    answers = iter([json.dumps({"model": "locost", "length": 8, "seconds": 1.0, "peak_rss_mib": 2.0})])

    def cell_then_interrupted(command, **kwargs):
        try:
            return subprocess.CompletedProcess(command, 0, stdout=next(answers) + "\n", stderr="")
        except StopIteration:
            raise KeyboardInterrupt from None

    monkeypatch.setattr(peers.subprocess, "run", cell_then_interrupted)
    monkeypatch.setattr(sys, "argv", ["benchmark_locost_vs_peers.py", "--lengths", "8", "--models", "locost",
                                      "longt5", "--json", str(tmp_path / "peers.json")])
    with pytest.raises(KeyboardInterrupt):
        peers.main()
    assert [cell["model"] for cell in json.loads((tmp_path / "peers.json").read_text())] == ["locost"]

    dodo = load_benchmark("benchmark_dodo")
    snapshots = []
    rows = dodo.run([32, 48], steps=1, rounds=1, warmup=0, device="cpu", on_row=lambda rows: snapshots.append(
        [row["context_tokens"] for row in rows]))
    assert snapshots == [[32], [32, 48]] and len(rows) == 2
    # no temporary left; the cells also appended to the .jsonl beside each --json
    assert sorted(path.name for path in tmp_path.iterdir()) == ["peers.json", "peers.jsonl", "vcc.json", "vcc.jsonl"]


def test_dodo_benchmark_runs_in_bfloat16():
    module = load_benchmark("benchmark_dodo")
    (row,) = module.run([64], steps=1, rounds=1, warmup=0, device="cpu", dtype="bfloat16", memory=True)
    assert row["dtype"] == "bfloat16" and row["nuggets"] == 7  # k = int(0.1·64 + 0.99)
    # keys and values of every layer, 2 bytes each: bfloat16 caches
    sizes = module.SIZES
    head_dim = sizes["hidden_size"] // sizes["num_attention_heads"]
    per_token = 2 * sizes["num_hidden_layers"] * sizes["num_key_value_heads"] * head_dim * 2
    assert row["kv_bytes_full_context"] == 64 * per_token
    assert row["kv_bytes_nuggets"] == 7 * per_token
    assert row["compress_phi_pass_s"] > 0 and row["compress_scorer_pass_s"] > 0  # the compression split in its passes
    # --memory: the prefill's peak holds at least its cache of the context (the compression keeps the φ pass's too)
    assert row["full_prefill_peak_bytes"] >= row["kv_bytes_full_context"]
    assert row["compress_peak_bytes"] >= row["kv_bytes_full_context"]
    assert "peak tensor memory" in module.markdown([row])


def test_dodo_compress_parts_time_both_passes_and_restore_the_model():
    import torch

    from longreach import DodoLlamaConfig, DodoLlamaForCausalLM

    module = load_benchmark("benchmark_dodo")
    torch.manual_seed(0)
    model = DodoLlamaForCausalLM(DodoLlamaConfig(**{**module.SIZES, "num_hidden_layers": 2, "nugget_layer": 1})).eval()
    context = torch.randint(3, 1024, (1, 48))
    calls = []

    def timed(function):
        calls.append(1)
        return function(), 0.25

    with torch.no_grad():
        expected = model.compress(context)
        nuggets, parts = module.compress_parts(model, context, timed)
        assert torch.equal(nuggets.indices, expected.indices)
        # one φ pass (the compressor's forward through `model.model`) and one scorer pass, each timed once
        assert (parts["compress_phi_pass_s"], parts["compress_scorer_pass_s"]) == (0.25, 0.25)
        assert len(calls) == 3 and parts["compress_rest_s"] == -0.25  # (the fake clock: 0.25 s for the whole call too)
        assert parts["compress_s"] == 0.25
        # the timing wrappers are gone: the methods are the class's again and compress gives the same nuggets
        assert "forward" not in vars(model.model) and "_scorer_features" not in vars(model)
        assert torch.equal(model.compress(context).indices, expected.indices)


def test_corpus_benchmark_runs_buckets_one_by_one_and_a_static_cache(capsys, tmp_path):
    module = load_benchmark("benchmark_corpus")
    results = module.main(["--quick", "--runs", "bucketed", "one_by_one", "bucketed_static", "bucketed_static_padded",
                           "--pad_to_multiple_of", "96", "--rounds", "2", "--json", str(tmp_path / "corpus.json")])
    assert json.loads((tmp_path / "corpus.json").read_text()) == list(results.values())
    assert sorted(path.name for path in tmp_path.iterdir()) == ["corpus.json"]  # written under a temporary name
    assert list(results) == ["bucketed", "one_by_one", "bucketed_static", "bucketed_static_padded"]
    assert all(run["documents"] == 8 and run["seconds"] > 0 for run in results.values())
    # two rounds each; the run's seconds are the second round's (the median of the rounds after the first)
    assert all(len(run["seconds_all"]) == 2 and run["seconds"] == run["seconds_all"][1] for run in results.values())
    assert results["one_by_one"]["batches"] == 8 and results["bucketed"]["batches"] == 1
    for name in ("one_by_one", "bucketed_static", "bucketed_static_padded"):
        assert results[name]["same_summaries_as_bucketed"] is True
    assert results["bucketed_static_padded"]["pad_to_multiple_of"] == 96
    assert "bucketed_static: " in capsys.readouterr().out


def test_corpus_benchmark_pads_inputs_to_a_multiple_and_undoes_it():
    module = load_benchmark("benchmark_corpus")
    args = argparse.Namespace(quick=True, documents=3, device="cpu", dtype="float32")
    summarizer, texts = module.build(args)
    plain, _ = summarizer._prepare_inputs(texts, None)
    undo = module.pad_inputs_to_multiple(summarizer, 96)
    padded, _ = summarizer._prepare_inputs(texts, None)
    width = plain["input_ids"].shape[1]
    assert width % 96 and padded["input_ids"].shape[1] == width + (-width % 96)  # the next multiple of 96
    assert torch.equal(padded["input_ids"][:, :width], plain["input_ids"])
    assert (padded["input_ids"][:, width:] == summarizer.model.config.pad_token_id).all()
    assert torch.equal(padded["attention_mask"].sum(dim=1), plain["attention_mask"].sum(dim=1))
    undo()
    assert summarizer._prepare_inputs(texts, None)[0]["input_ids"].shape[1] == width
    with pytest.raises(ValueError, match="--pad_to_multiple_of"):
        module.main(["--quick", "--pad_to_multiple_of", "0"])
    with pytest.raises(ValueError, match="--rounds"):
        module.main(["--quick", "--rounds", "0"])


def test_count_ops_counts_a_training_step_on_the_meta_device(tmp_path, capsys):
    """benchmarks/count_ops.py --quick: LOCOST's and T5's training steps counted (more operators than the forward
    pass alone, views apart), the source lines named, the cells written to JSON under a temporary name."""
    module = load_benchmark("count_ops")
    cells = module.main(["--quick", "--models", "locost", "t5", "--tasks", "train", "encode",
                         "--json", str(tmp_path / "ops.json")])
    assert [(c["model"], c["task"]) for c in cells] == [("locost", "train"), ("t5", "train"), ("locost", "encode"),
                                                        ("t5", "encode")]
    for cell in cells:
        assert 0 < cell["views"] < cell["operators"] and 0 < cell["forward_operators"] <= cell["operators"]
        assert sum(count for _, count in cell["top_operators"]) <= cell["operators"]
    train, encode = cells[0], cells[2]
    assert train["forward_operators"] < train["operators"] and encode["forward_operators"] == encode["operators"]
    assert any(site.startswith("ssm.py:") for site, _ in train["top_sites"])  # LOCOST's own lines are named
    assert json.loads((tmp_path / "ops.json").read_text()) == [json.loads(json.dumps(c)) for c in cells]
    assert [path.name for path in tmp_path.iterdir()] == ["ops.json"]
    assert "| locost | train | 64 |" in capsys.readouterr().out


def test_count_ops_classifies_views_and_in_place_operators():
    import torch

    module = load_benchmark("count_ops")
    aten = torch.ops.aten
    assert module.is_view(aten.slice.Tensor) and module.is_view(aten.t.default) and module.is_view(aten.detach.default)
    assert not module.is_view(aten.add_.Tensor) and not module.is_view(aten.copy_.default)
    assert not module.is_view(aten.mul.Tensor) and not module.is_view(aten._to_copy.default)


def test_demo_recipe_judges_on_validation_documents_split_from_training_never_held_out_ones(tmp_path, capsys):
    """benchmarks/demo_recipe.py --smoke: trains both stages, takes its validation set out of the training documents
    (disjoint from the demo's held-out set), and appends its result line to --json (no score asserted: the smoke
    model is untrained)."""
    import hashlib

    from longreach import demo

    module = load_benchmark("demo_recipe")
    train, held_out = demo.build_corpus(15)
    kept, validation = module.split_validation(train)
    assert validation and len(kept) + len(validation) <= len(train)
    rest = [e for e in train if e not in validation]
    # what is left out of training repeats a scored validation document's summary or lead
    scored = [e for e in validation if len(e["document"].split()) >= demo.MIN_DOCUMENT_WORDS]
    assert set(map(id, kept)) <= set(map(id, rest)) and len(kept) > 0.95 * len(rest)
    kept_text = [" ".join(e["document"].lower().split()) for e in kept]
    for example in scored:
        for quoted in (example["summary"], demo.lead_baseline(example["document"])):
            quoted = " ".join(quoted.lower().split()).rstrip(".!?:;, ")
            assert len(quoted.split()) < 4 or not [text for text in kept_text if quoted in text]
    names = {e["name"] for e in held_out}
    assert not names & {e["name"] for e in kept + validation}
    assert {int(hashlib.sha256(f"{e['source']}:{e['name']}".encode()).hexdigest(), 16) % demo.HELD_OUT_EVERY
            for e in validation} == {module.VALIDATION_BUCKET}
    assert {demo.document_bucket(e) for e in held_out} == {0}

    other_kept, other_validation = module.split_validation(train, 2)  # another fold: disjoint validation sets
    assert other_validation and not {e["name"] for e in other_validation} & {e["name"] for e in validation}
    with pytest.raises(ValueError, match="`bucket` must be 1 to 9"):
        module.split_validation(train, 0)  # the demo's held-out bucket is never a validation set

    out, summaries = tmp_path / "runs.jsonl", tmp_path / "fold2.jsonl"
    result = module.main(["--smoke", "--seed", "1", "--synthetic_copy_steps", "2", "--stage2_dropout", "0.1",
                          "--validation_bucket", "2", "--summaries", str(summaries), "--json", str(out)])
    assert result["validation_bucket"] == 2
    rows = [json.loads(line) for line in summaries.read_text().splitlines()]
    assert len(rows) == result["validation_documents"] and all(set(r) == {"name", "reference", "lead", "summary"}
                                                                 for r in rows)
    assert {r["name"] for r in rows} <= {e["name"] for e in other_validation}
    assert not list(tmp_path.glob("*.tmp"))
    assert result["validation_documents"] > 0 and len(result["stage1_losses"]) == 2 and result["stage2_dropout"] == 0.1
    assert len(result["synthetic_losses"]) == 2 and result["stage2_copy_loss_128"] > 0
    assert result["margin"] == round(result["rouge"]["rouge1"] - result["lead"]["rouge1"], 2)
    assert -100.0 <= result["margin_interval"][0] <= result["margin_interval"][1] <= 100.0
    assert 0.0 <= result["lead_exact"] <= 1.0
    assert json.loads(out.read_text().splitlines()[-1]) == result
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1]) == result


def test_demo_recipe_pools_the_summaries_of_several_folds(tmp_path):
    module = load_benchmark("demo_recipe")
    first, second = tmp_path / "fold1.jsonl", tmp_path / "fold2.jsonl"
    first.write_text(json.dumps({"name": "statistics:median:10", "reference": "the middle value of data",
                                 "lead": "data points", "summary": "the middle value of data"}) + "\n")
    second.write_text(json.dumps({"name": "requests", "reference": "http for humans", "lead": "http for humans",
                                  "summary": "zebra"}) + "\n")
    pooled = module.main(["--pool", str(first), str(second)])
    assert pooled["files"] == 2 and pooled["documents"] == 2
    # the docstring: summary exact, lead shares "data" (F1 2/7); the README: summary shares nothing, lead exact
    assert pooled["docstrings"]["margin"] == round(100 - 100 * 2 / 7, 2)
    assert pooled["readmes"]["margin"] == -100.0
    halves = (pooled["docstrings"]["margin"] + pooled["readmes"]["margin"]) / 2
    assert pooled["margin"] == pytest.approx(halves, abs=0.01)
    low, high = pooled["margin_interval"]
    assert -100.0 <= low < 0.0 < high <= 100.0
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    with pytest.raises(ValueError, match="hold no summaries"):
        module.pooled_margin([str(empty)])


def test_demo_recipe_set_dropout_reaches_every_dropout_of_the_model():
    """--stage2_dropout's helper sets the Dropout modules and the attention's probability dropout (a float) alike."""
    from torch import nn

    from longreach import LocostConfig, LocostForConditionalGeneration

    module = load_benchmark("demo_recipe")
    model = LocostForConditionalGeneration(LocostConfig(vocab_size=32, d_model=16, d_state=4, d_kv=4, d_ff=32,
                                                        num_layers=1, num_decoder_layers=1, num_heads=4,
                                                        dropout_rate=0.0))
    module.set_dropout(model, 0.25)
    dropouts = [m.p for m in model.modules() if isinstance(m, nn.Dropout)]
    attention = [m.dropout for m in model.modules() if isinstance(getattr(m, "dropout", None), float)]
    assert dropouts and attention and set(dropouts) == set(attention) == {0.25}
    assert model.config.dropout_rate == 0.25


def test_cpu_peak_memory_does_not_count_earlier_profiler_sessions(run_all):
    """The CPU allocator's running total carries over between profiler sessions of one process (a tensor allocated
    while profiling and freed outside it is never subtracted): each session's peak is taken above its start."""
    device = torch.device("cpu")
    kept = []
    first, _, _ = run_all.peak_tensor_bytes(lambda: kept.append(torch.ones(25_000_000)), device)  # ~95 MiB, kept
    kept.clear()  # freed outside the profiler
    second, _, _ = run_all.peak_tensor_bytes(lambda: torch.ones(250_000), device)  # ~1 MiB
    assert first >= 100_000_000 and 1_000_000 <= second < 2_000_000


def test_fresh_removes_only_what_run_all_writes_and_a_resume_refuses_other_settings(run_all, tmp_path, monkeypatch):
    """`--fresh` (default --out: benchmarks/results/, which holds hand-written reports) removes the cells and the
    reports run_all writes, nothing else; a rerun with other --threads / --repeats refuses to mix its cells with the
    finished ones, which it would have skipped and reported beside the new ones as if measured alike."""
    (tmp_path / "cuda.md").write_text("a hand-written report\n")
    argv = ["--quick", "--suites", "locost", "--models", "locost", "--tasks", "encode", "--lengths", "32",
            "--threads", "1", "--skip_flops", "--cells_only", "--out", str(tmp_path)]
    monkeypatch.setattr(run_all, "run_in_subprocess", lambda cell, timeout: run_all.run_cell(cell))
    run_all.main(argv)
    with pytest.raises(SystemExit, match=r"measured otherwise \(threads 1 there, 2 now\): pass --fresh"):
        run_all.main([*argv[:-4], "--threads", "2", "--skip_flops", "--cells_only", "--out", str(tmp_path)])
    (tmp_path / "README.md").write_text("# Benchmarks\n\nan earlier report\n")
    (tmp_path / "vcc_t5.md").write_text("table\n")
    run_all.main([*argv, "--fresh"])
    assert sorted(path.name for path in tmp_path.iterdir()) == ["cells.jsonl", "cuda.md"]
    assert (tmp_path / "cuda.md").read_text() == "a hand-written report\n"


def test_script_suite_reports_are_reused_only_for_the_same_options(run_all, tmp_path, monkeypatch):
    runs = []

    def fake_run(command, timeout):
        runs.append(command)
        assert command[-2:] == ["--jsonl", str(tmp_path / "vcc_t5.jsonl")]  # its cells, appended as they finish
        return 0, f"| table of {' '.join(command[1:-2])} |", ""

    monkeypatch.setattr(run_all, "run_script", fake_run)
    float32 = ["benchmark_vcc_t5.py", "--device", "cpu", "--dtype", "float32"]
    assert run_all.script_suite("vcc_t5", float32, tmp_path, 10) == "| table of --device cpu --dtype float32 |"
    assert run_all.script_suite("vcc_t5", float32, tmp_path, 10) == "| table of --device cpu --dtype float32 |"
    assert len(runs) == 1  # reused
    bfloat16 = [*float32[:-1], "bfloat16"]
    assert run_all.script_suite("vcc_t5", bfloat16, tmp_path, 10) == "| table of --device cpu --dtype bfloat16 |"
    assert len(runs) == 2  # other options: measured again, not the float32 table under a bfloat16 header
    assert run_all.script_suite("vcc_t5", float32, tmp_path, 10, run=False) == \
        "| table of --device cpu --dtype bfloat16 |"  # --report_only: the report as it is, nothing run
    assert len(runs) == 2


def test_fft_size_benchmark_times_both_sizes_and_restores_the_default(monkeypatch, capsys):
    """benchmarks/benchmark_fft_size.py at tiny sizes: one line per length, with both FFT sizes, and the module's
    threshold as it was afterwards."""
    from longreach.modeling import ssm

    default = ssm.SMOOTH_FFT_FROM_LENGTH
    monkeypatch.setattr(sys, "argv", ["benchmark_fft_size.py", "--channels", "4", "--lengths", "8", "13"])
    load_benchmark("benchmark_fft_size").main()
    lines = capsys.readouterr().out.strip().splitlines()
    assert [line.split(":")[0] for line in lines] == ["L=8", "L=13"]
    assert "26 points" in lines[1] and "25 points" in lines[1]  # 2L, and the next 5-smooth size >= 2L - 1
    assert ssm.SMOOTH_FFT_FROM_LENGTH == default


FAKE_SCRIPT = """
import argparse, json, subprocess, sys, time

parser = argparse.ArgumentParser()
parser.add_argument("--then", choices=["hang", "crash"])
parser.add_argument("--jsonl")
parser.add_argument("--report_only", action="store_true")
args = parser.parse_args()
if args.report_only:
    rows = [json.loads(line) for line in open(args.jsonl)]
    print("| " + " | ".join(str(row["length"]) for row in rows) + " |")
    sys.exit(0)
with open(args.jsonl, "a") as handle:
    handle.write(json.dumps({"length": 8}) + "\\n")
if args.then == "crash":
    sys.exit("the 16-token cell: out of memory")
cell = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])  # a cell's own process
open(args.jsonl + ".pid", "w").write(str(cell.pid))
time.sleep(120)
"""


def process_gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as handle:
            return handle.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")  # a zombie measures nothing
    except FileNotFoundError:
        return True


def test_script_suite_keeps_the_rows_finished_before_a_timeout_or_a_crash(run_all, tmp_path):
    """A script suite runs as one process under one --timeout: its rows, appended to NAME.jsonl as they finish,
    survive a timeout or a crash and are shown under what happened; the cell processes it started are killed with it;
    no report is written, so a rerun resumes."""
    script = tmp_path / "fake_suite.py"
    script.write_text(FAKE_SCRIPT)
    text = run_all.script_suite("vcc_t5", [str(script), "--then", "hang"], tmp_path, 5)
    assert text.startswith("timeout after 5 s: the table holds what finished before (in vcc_t5.jsonl; a rerun resumes")
    assert text.endswith("| 8 |")
    assert not (tmp_path / "vcc_t5.md").exists()
    pid = int((tmp_path / "vcc_t5.jsonl.pid").read_text())
    for _ in range(50):  # reaped by whoever adopted it
        if process_gone(pid):
            break
        time.sleep(0.1)
    assert process_gone(pid)
    text = run_all.script_suite("dodo", [str(script), "--then", "crash"], tmp_path, 60)
    assert text.startswith("failed (exit 1): the 16-token cell: out of memory: the table holds what finished")
    assert text.endswith("| 8 |") and not (tmp_path / "dodo.md").exists()
    # --report_only: the finished rows of a suite that has no report yet
    assert run_all.script_suite("dodo", [str(script)], tmp_path, 60, run=False).startswith("not finished: the table")


# run_all, stopped by SIGTERM while a script suite runs: the suite (its own process group) must go with it
SIGTERMED_SUITE = """
import importlib.util, sys
spec = importlib.util.spec_from_file_location("run_all", sys.argv[1])
run_all = importlib.util.module_from_spec(spec)
spec.loader.exec_module(run_all)
with run_all.exit_on_sigterm():
    run_all.script_suite("vcc_t5", [sys.argv[2], "--then", "hang"], run_all.Path(sys.argv[3]), 120)
"""


def test_sigterm_to_run_all_ends_the_script_suite_it_runs(tmp_path):
    """The script suites run in a process group of their own (so that a timeout kills their cells too): a SIGTERM to
    run_all (a scheduler's time limit) must end them, and their cells, rather than leave them measuring."""
    import signal
    import subprocess
    import sys

    script = tmp_path / "fake_suite.py"
    script.write_text(FAKE_SCRIPT)
    process = subprocess.Popen([sys.executable, "-c", SIGTERMED_SUITE, str(BENCHMARKS / "run_all.py"), str(script),
                                str(tmp_path)], stderr=subprocess.PIPE, text=True)
    pid_file = tmp_path / "vcc_t5.jsonl.pid"
    for _ in range(300):
        if pid_file.exists() and pid_file.read_text():
            break
        assert process.poll() is None, process.stderr.read()
        time.sleep(0.1)
    cell = int(pid_file.read_text())
    process.send_signal(signal.SIGTERM)
    assert process.wait(timeout=60) == 143, process.stderr.read()
    process.stderr.close()
    for _ in range(50):
        if process_gone(cell):
            break
        time.sleep(0.1)
    assert process_gone(cell)


def test_a_journal_line_cut_by_a_kill_is_dropped_before_the_next_cell_is_appended(run_all, tmp_path):
    journal = tmp_path / "cells.jsonl"
    journal.write_text('{"model": "a", "length": 1}\n{"model": "b", "len')  # killed while writing b
    assert run_all.load_cells(journal) == [{"model": "a", "length": 1}]
    run_all.append_cell(journal, {"model": "c", "length": 3})
    assert run_all.load_cells(journal) == [{"model": "a", "length": 1}, {"model": "c", "length": 3}]
    assert journal.read_text().endswith("}\n")
    empty = tmp_path / "empty.jsonl"
    run_all.append_cell(empty, {"model": "d"})  # a new file
    assert run_all.load_cells(empty) == [{"model": "d"}]


def test_benchmark_scripts_resume_from_their_jsonl_and_refuse_other_settings(monkeypatch, tmp_path):
    """--json (or --jsonl) scripts append each finished cell to a JSONL file; a rerun with the same settings measures
    only what is missing, one with other settings is refused, --fresh starts over. --json holds every cell, resumed
    ones included, and is renamed into place."""
    vcc = load_benchmark("benchmark_vcc_t5")
    measured, stop_at = [], [("vcc", 16)]

    def fake_cell(model, length, args):
        if (model, length) in stop_at:
            stop_at.clear()
            raise KeyboardInterrupt  # the first run stops there
        measured.append((model, length))
        return {"model": model, "length": length, "seconds_median": 1.0, "peak_rss_mib": 2.0}

    monkeypatch.setattr(vcc, "run_in_subprocess", fake_cell)
    argv = ["benchmark_vcc_t5.py", "--vcc_lengths", "8", "16", "--t5_lengths", "8", "--json",
            str(tmp_path / "vcc.json")]
    monkeypatch.setattr(sys, "argv", argv)
    with pytest.raises(KeyboardInterrupt):
        vcc.main()
    assert measured == [("vcc", 8)] and len((tmp_path / "vcc.jsonl").read_text().splitlines()) == 1
    vcc.main()
    assert measured == [("vcc", 8), ("vcc", 16), ("t5", 8)]  # the 8-token VCC cell was not measured again
    cells = json.loads((tmp_path / "vcc.json").read_text())
    assert [(cell["model"], cell["length"], cell["threads"]) for cell in cells] == [("vcc", 8, 2), ("vcc", 16, 2),
                                                                                    ("t5", 8, 2)]
    vcc.main()
    assert len(measured) == 3  # all finished: nothing measured
    monkeypatch.setattr(sys, "argv", [*argv, "--threads", "1"])
    with pytest.raises(SystemExit, match=r"vcc 8 cell measured otherwise \(threads 2 there, 1 now\): pass --fresh"):
        vcc.main()
    monkeypatch.setattr(sys, "argv", [*argv, "--threads", "1", "--fresh"])
    vcc.main()
    assert measured[3:] == [("vcc", 8), ("vcc", 16), ("t5", 8)]
    assert sorted(path.name for path in tmp_path.iterdir()) == ["vcc.json", "vcc.jsonl"]

    peers = load_benchmark("benchmark_locost_vs_peers")
    measured.clear()
    monkeypatch.setattr(peers, "measure", lambda model, length, args: measured.append((model, length)) or
                        {"model": model, "length": length, "seconds": 1.0, "peak_rss_mib": 2.0})
    argv = ["benchmark_locost_vs_peers.py", "--models", "locost", "t5", "--jsonl", str(tmp_path / "peers.jsonl"),
            "--lengths", "8"]
    monkeypatch.setattr(sys, "argv", argv)
    peers.main()
    monkeypatch.setattr(sys, "argv", [*argv, "16"])
    peers.main()
    assert measured == [("locost", 8), ("t5", 8), ("locost", 16), ("t5", 16)]
    monkeypatch.setattr(sys, "argv", [*argv, "--repeats", "1"])
    with pytest.raises(SystemExit, match=r"repeats 3 there, 1 now"):
        peers.main()

    dodo = load_benchmark("benchmark_dodo")
    real_run, lengths_run = dodo.run, []
    monkeypatch.setattr(dodo, "run", lambda lengths, *a, **k: lengths_run.append(lengths) or real_run(lengths, *a, **k))
    argv = ["benchmark_dodo.py", "--steps", "1", "--rounds", "1", "--warmup", "0", "--json",
            str(tmp_path / "dodo.json"), "--lengths", "32"]
    monkeypatch.setattr(sys, "argv", argv)
    dodo.main()
    monkeypatch.setattr(sys, "argv", [*argv, "48"])
    dodo.main()
    assert lengths_run == [[32], [48]]
    assert [row["context_tokens"] for row in json.loads((tmp_path / "dodo.json").read_text())] == [32, 48]
    monkeypatch.setattr(sys, "argv", [*argv[:2], "2", *argv[3:]])
    with pytest.raises(SystemExit, match=r"decode 32-token cell measured otherwise \(steps 1 there, 2 now\)"):
        dodo.main()
    assert not list(tmp_path.glob("*.tmp"))


def test_resumed_run_all_refuses_cells_of_another_thread_count_or_ssm_kernel(run_all, tmp_path, monkeypatch):
    """The thread count a cell ran with (--threads, or torch's default) and the CPU SSM kernel (compiled or torch ops)
    are recorded in each cell: a rerun, or a --report_only report, refuses to put cells of two settings in one table."""
    from longreach.modeling import ssm_cpu_kernel

    argv = ["--quick", "--suites", "locost", "--models", "locost", "--tasks", "encode", "--lengths", "32",
            "--skip_flops", "--cells_only", "--out", str(tmp_path)]
    monkeypatch.setattr(run_all, "run_in_subprocess", lambda cell, timeout: run_all.run_cell(cell))
    monkeypatch.delenv(ssm_cpu_kernel.BACKEND_VARIABLE, raising=False)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)  # torch's default in this process: no --threads
        run_all.main(argv)
        (cell,) = run_all.load_cells(tmp_path / "cells.jsonl")
        assert cell["threads"] == cell["threads_used"] == 1
        torch.set_num_threads(2)
        with pytest.raises(SystemExit, match=r"locost encode 32 cell measured otherwise \(threads 1 there, 2 now\)"):
            run_all.main(argv)
        if cell["ssm_kernel"] == "compiled":  # where a C compiler works
            monkeypatch.setenv(ssm_cpu_kernel.BACKEND_VARIABLE, "torch")
            with pytest.raises(SystemExit, match=r"\(ssm_kernel 'compiled' there, 'torch' now\)"):
                run_all.main([*argv, "--threads", "1"])
        else:
            assert cell["ssm_kernel"] == "torch" and ssm_cpu_kernel.load() is None
    finally:
        torch.set_num_threads(threads)
    other = {**cell, "length": 64, "threads": 2, "threads_used": 2}  # a cell of another run
    run_all.append_cell(tmp_path / "cells.jsonl", other)
    with pytest.raises(SystemExit, match=r"several thread counts / SSM kernels \(1 threads and SSM kernel"):
        run_all.main(["--report_only", "--suites", "locost", "--out", str(tmp_path)])


def test_report_only_keeps_results_of_other_dtypes_apart(run_all, tmp_path):
    """--report_only heads one report with one device and dtype: a script suite's report of another dtype than the
    LOCOST cells is refused (it was included under the cells' header), and a report with no cells takes the suites'."""
    committed = Path(__file__).resolve().parents[1] / "benchmarks" / "results" / "cells.jsonl"
    cell = json.loads(committed.read_text().splitlines()[0])  # float32, CPU
    with open(tmp_path / "cells.jsonl", "w") as handle:
        handle.write(json.dumps(cell) + "\n")
    (tmp_path / "vcc_t5.md").write_text("<!-- run_all: benchmark_vcc_t5.py --vcc_lengths 1024 --device cpu --dtype "
                                        "bfloat16 --threads 1 -->\n| a bfloat16 table |\n")
    argv = ["--report_only", "--suites", "locost", "vcc", "--out", str(tmp_path)]
    with pytest.raises(SystemExit, match=r"the LOCOST cells of cells.jsonl: cpu, float32; vcc_t5: cpu, bfloat16"):
        run_all.main(argv)
    run_all.main(["--report_only", "--suites", "locost", "--out", str(tmp_path)])  # the suite left out: reported
    (tmp_path / "cells.jsonl").unlink()
    text = run_all.main(argv).read_text()
    assert "; device cpu, bfloat16." in text.split("\n")[2] and "| a bfloat16 table |" in text
    # LOCOST cells of two dtypes were refused already (one table per model, task and length)
    with open(tmp_path / "cells.jsonl", "w") as handle:
        for dtype in ("float32", "bfloat16"):
            handle.write(json.dumps({**cell, "dtype": dtype}) + "\n")
    with pytest.raises(SystemExit, match="several devices / dtypes / quick settings"):
        run_all.main(["--report_only", "--suites", "locost", "--out", str(tmp_path)])


def test_vcc_t5_benchmark_memory_does_not_count_the_t5_copy(run_all, monkeypatch):
    """A VCC cell builds the T5 model to copy its weights into VCC-T5: the memory in the table is the forward's peak
    RSS above a baseline taken with both alive, so neither that copy nor either model's weights are counted (the
    table showed the whole process's peak, with both copies)."""
    if not run_all.reset_peak_rss():
        pytest.skip("the peak RSS cannot be reset here (not Linux)")
    module = load_benchmark("benchmark_vcc_t5")
    module.run_cell("vcc", 1024, threads=1, repeats=1, attention="sdpa")  # a process's first forward loads code
    vocab_size = 1_600_000  # a 391 MiB embedding in each model
    monkeypatch.setitem(module.DIMS, "small", {**module.SIZES, "vocab_size": vocab_size})
    cells = [module.run_cell(model, 1024, threads=1, repeats=1, attention="sdpa") for model in ("vcc", "t5")]
    (row,) = [line for line in module.table(cells).splitlines() if line.startswith("| 1024 |")]
    vcc_memory, t5_memory = float(row.split("|")[3]), float(row.split("|")[6])
    copy_mib = vocab_size * module.SIZES["d_model"] * 4 / 2**20
    assert "peak RSS above weights" in module.table(cells)
    assert 0 <= vcc_memory < copy_mib / 2 and 0 <= t5_memory < copy_mib / 2, (vcc_memory, t5_memory)
    assert cells[0]["peak_rss_mib"] > 2 * copy_mib  # the whole process's peak, both copies: kept in the JSON only


def test_a_readme_in_out_that_is_not_a_report_is_neither_replaced_nor_deleted(run_all, tmp_path):
    """`--out .` in a project's folder: its README.md was replaced by the report (and deleted by --fresh)."""
    readme = tmp_path / "README.md"
    readme.write_text("# My project\n")
    for options in (["--report_only"], ["--fresh", "--cells_only"]):
        with pytest.raises(SystemExit, match=f"{readme} is not a report of run_all.py"):
            run_all.main([*options, "--suites", "locost", "--out", str(tmp_path)])
        assert readme.read_text() == "# My project\n"
    assert sorted(path.name for path in tmp_path.iterdir()) == ["README.md"]
