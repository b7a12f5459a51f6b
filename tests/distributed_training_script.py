"""Trains a tiny LOCOST or Dodo with `Trainer` for a few steps and writes the loss curve; run by test_distributed.py
alone (`python`) or under `torchrun --nproc_per_node=2` (gloo on CPU). Batches are taken in order (no shuffling) so
that one process with batch 2b sees exactly the examples that two processes with batch b see together."""

from __future__ import annotations

import faulthandler
import json
import os
import sys
from pathlib import Path

import torch
from torch.utils.data import SequentialSampler
from transformers import Trainer, TrainingArguments

sys.path.insert(0, str(Path(__file__).parent))

STEPS = 4


class InOrderTrainer(Trainer):
    """Batches in dataset order; under several processes accelerate hands batch i to process i mod world_size, so one
    optimizer step sees the same examples as one process with a batch world_size times larger."""

    def _get_train_sampler(self, *args, **kwargs):
        return SequentialSampler(self.train_dataset)


def build(kind: str):
    generator = torch.Generator().manual_seed(1)
    if kind == "locost":
        from longreach import LocostConfig, LocostForConditionalGeneration

        torch.manual_seed(0)
        model = LocostForConditionalGeneration(LocostConfig(
            vocab_size=99, d_model=32, d_state=8, d_kv=8, d_ff=64, num_layers=2, num_heads=4, dropout_rate=0.0))
        rows = [{"input_ids": torch.randint(3, 99, (24,), generator=generator).tolist(),
                 "labels": torch.randint(3, 99, (6,), generator=generator).tolist()} for _ in range(16)]
    else:
        from test_modeling_dodo import tiny_model

        model = tiny_model()
        rows = []
        for _ in range(16):
            prompt = torch.randint(3, 100, (8,), generator=generator).tolist()
            rows.append({"input_ids": prompt, "labels": prompt,
                         "context_input_ids": torch.randint(3, 100, (30,), generator=generator).tolist()})
    return model.train(), rows


def main() -> None:
    kind, output_dir, per_device = sys.argv[1], sys.argv[2], int(sys.argv[3])
    torch.manual_seed(0)
    model, rows = build(kind)
    arguments = TrainingArguments(
        output_dir=output_dir, per_device_train_batch_size=per_device, max_steps=STEPS, learning_rate=5e-3,
        lr_scheduler_type="constant", logging_steps=1, save_strategy="no", report_to="none", use_cpu=True,
        ddp_backend="gloo" if int(os.environ.get("WORLD_SIZE", 1)) > 1 else None, dataloader_num_workers=0, seed=0,
        disable_tqdm=True, ddp_timeout=120,  # a collective that waits longer raises instead of hanging for 30 minutes
    )
    trainer = InOrderTrainer(model=model, args=arguments, train_dataset=rows)
    trainer.train()
    # what follows takes seconds; should it hang, every thread's stack goes to stderr and the process exits with 1
    faulthandler.dump_traceback_later(90, exit=True)
    if trainer.is_world_process_zero():
        trainer.save_model(Path(output_dir) / "final")
        losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
        (Path(output_dir) / "losses.json").write_text(json.dumps(losses))
    if torch.distributed.is_initialized():
        # Every rank waits for rank 0's files (the barrier is bounded by ddp_timeout). Then the process leaves with
        # os._exit and skips both destroy_process_group and the interpreter's teardown: the first can hang with a small
        # probability (pytorch/pytorch#75097; a 2-process run of this script hung after training in CI), the second
        # can abort while gloo's threads still run ("terminate called without an active exception": seen once).
        # Nothing is left to release: the process ends here, and its files are written and closed.
        torch.distributed.barrier()
        faulthandler.cancel_dump_traceback_later()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
    faulthandler.cancel_dump_traceback_later()


if __name__ == "__main__":
    main()
