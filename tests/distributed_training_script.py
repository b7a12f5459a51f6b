"""Trains a tiny LOCOST, VCC-T5 or Dodo with `Trainer` for a few steps and writes the loss curve; run by
test_distributed.py alone (`python`) or under `torchrun --nproc_per_node=2` (gloo on CPU). Batches are taken in order
(no shuffling) so that one process with batch 2b sees exactly the examples that two processes with batch b see together.

With a fourth argument `fsdp` (under torchrun) the model is sharded with FSDP2 (`torch.distributed.fsdp.fully_shard`)
and trained by the loop in `train_fsdp`, which does what `Trainer` does here: `Trainer` cannot shard on the CPU, since
accelerate enables FSDP only for accelerator devices (on a CPU-only run `fsdp=True` trains with plain DDP).
With `zero3` the model is partitioned by DeepSpeed ZeRO-3 (its CPU accelerator, gloo) and trained by the loop in
`train_zero3`, the same step through DeepSpeed's engine.
"""

from __future__ import annotations

import faulthandler
import json
import os
import sys
from pathlib import Path

import torch
from torch.utils.data import SequentialSampler
from transformers import Trainer, TrainingArguments, default_data_collator

sys.path.insert(0, str(Path(__file__).parent))

STEPS = 4
LEARNING_RATE = 5e-3

# FSDP units under `fsdp`, besides the root: the classes accelerate would wrap for `transformer_layer_cls_to_wrap`
# (by isinstance). LOCOST and VCC-T5: their `_no_split_modules`, one unit per block (VCC-T5's encoder asks a block's
# forward for block 0's relative-bias table and for a VCC layer's selection logits, so those gather the block's
# weights too). Dodo: one unit per `LlamaDecoderLayer` (its `_no_split_modules`); each layer runs in the compression
# pass and in the decoder pass, and the compression passes' unused outputs are joined to the nuggets so that a sharded
# layer gathers its weights for both backward passes (`_ZeroGradientTie` in modeling_dodo.py). `dodo_reencode`: the
# authors' `auto=True` nuggets (two compression passes) with gradient checkpointing; `dodo_autoregressive`: the
# autoregressive mode (`recent_window`), whose θ pass over the recent tokens after a compression is unused too.
FSDP_UNITS = {"locost": ("LocostEncoderBlock", "T5Block"), "vcc_t5": ("VCCT5EncoderBlock", "T5Block"),
              **{kind: ("LlamaDecoderLayer",) for kind in ("dodo", "dodo_reencode", "dodo_autoregressive")}}


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
        # (encoder_chunk_length: without autograd, an input longer than 16 positions takes the long-input path)
        model = LocostForConditionalGeneration(LocostConfig(
            vocab_size=99, d_model=32, d_state=8, d_kv=8, d_ff=64, num_layers=2, num_heads=4, dropout_rate=0.0,
            encoder_chunk_length=16))
        rows = [{"input_ids": torch.randint(3, 99, (24,), generator=generator).tolist(),
                 "labels": torch.randint(3, 99, (6,), generator=generator).tolist()} for _ in range(16)]
    elif kind == "vcc_t5":
        from test_modeling_vcc_t5 import tiny_model

        torch.manual_seed(0)
        # no random exploration of the block order: one process and two draw different random numbers
        model = tiny_model(exploration_probability=0.0)
        rows = [{"input_ids": torch.randint(3, 200, (64,), generator=generator).tolist(),
                 "vip_mask": [1] * 4 + [0] * 60,
                 "labels": torch.randint(3, 200, (6,), generator=generator).tolist()} for _ in range(16)]
    else:
        from test_modeling_dodo import tiny_model

        settings = {"dodo_reencode": {"nugget_encoding": "reencode"},
                    "dodo_autoregressive": {"recent_window": 4, "compression_stride": 6}}.get(kind, {})
        model = tiny_model(**settings)
        if kind == "dodo_reencode":
            model.gradient_checkpointing_enable()
        rows = []
        for _ in range(16):
            if kind == "dodo_autoregressive":  # a text of 24 tokens, compressed twice on its way (after 10, then 16)
                text = torch.randint(3, 100, (24,), generator=generator).tolist()
                rows.append({"input_ids": text, "labels": text})
                continue
            prompt = torch.randint(3, 100, (8,), generator=generator).tolist()
            rows.append({"input_ids": prompt, "labels": prompt,
                         "context_input_ids": torch.randint(3, 100, (30,), generator=generator).tolist()})
    return model.train(), rows


def train_fsdp(kind: str, model, rows, output_dir: str, per_device: int) -> None:
    """FSDP2 on the process group (gloo), as accelerate 1.15 prepares it for `Trainer` (`fsdp2_prepare_model`: units
    of the `FSDP_UNITS` classes, bottom-up; the input embedding as a unit of its own unless the output embedding is
    tied to it; a tail unit of the base model's final norm and the output embedding, with the input embedding where
    tied, kept gathered after the forward pass; then the root), and `Trainer`'s step: AdamW (fused, no weight decay,
    constant rate), gradients clipped to norm 1, batch i to process i mod world_size; the logged loss is the mean over
    processes. The full state dict is gathered on every process and rank 0 saves it with `save_pretrained`, as
    `Trainer.save_model` does under FSDP."""
    from datetime import timedelta

    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FSDPModule, fully_shard
    from torch.distributed.tensor import DTensor

    torch.distributed.init_process_group("gloo", timeout=timedelta(seconds=120))
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    classes = tuple({type(module) for module in model.modules() if type(module).__name__ in FSDP_UNITS[kind]})
    for module in reversed(list(model.modules())[1:]):  # bottom-up, as accelerate
        if classes and isinstance(module, classes) and not isinstance(module, FSDPModule):
            fully_shard(module, mesh=mesh)
    input_embedding, output_embedding = model.get_input_embeddings(), model.get_output_embeddings()
    tied = input_embedding.weight is output_embedding.weight
    if not tied:
        fully_shard(input_embedding, mesh=mesh)
    base = getattr(model, model.base_model_prefix, None)  # accelerate's final norm: the last *Norm* child of the base
    norms = [module for _, module in base.named_children() if "Norm" in type(module).__name__] if base else []
    tail = norms[-1:] + ([input_embedding] if tied else []) + [output_embedding]
    fully_shard(tail, mesh=mesh, reshard_after_forward=False)
    fully_shard(model, mesh=mesh)
    trainable = [param for param in model.parameters() if param.requires_grad]
    assert all(isinstance(param, DTensor) for param in model.parameters())  # every parameter is sharded
    optimizer = torch.optim.AdamW(trainable, lr=LEARNING_RATE, weight_decay=0.0, fused=True)
    losses = []
    for step in range(STEPS):
        start = (step * world + rank) * per_device
        batch = default_data_collator(rows[start : start + per_device])
        loss = model(**batch).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(trainable, 1.0)
        optimizer.step()
        optimizer.zero_grad()
        logged = loss.detach().clone()
        torch.distributed.all_reduce(logged)
        losses.append(logged.item() / world)
    # what follows takes seconds; should it hang, every thread's stack goes to stderr and the process exits with 1
    faulthandler.dump_traceback_later(90, exit=True)
    run = {"units": sum(isinstance(module, FSDPModule) for module in model.modules()), "class": type(model).__name__}
    if kind == "locost":  # evaluation of a long input: the encoder's in-place path by pieces, then the ordinary one
        model.eval()
        batch = default_data_collator(rows[:per_device])  # 24 positions, pieces of 16
        with torch.no_grad():
            pieces = model(**batch).logits
            model.encoder.chunk_length = None
            run["pieces_vs_whole"] = (pieces - model(**batch).logits).abs().max().item()
    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if rank == 0:
        model.save_pretrained(Path(output_dir) / "final", state_dict=state)
        (Path(output_dir) / "losses.json").write_text(json.dumps(losses))
        (Path(output_dir) / "fsdp.json").write_text(json.dumps(run))
    leave_distributed()


def train_zero3(model, rows, output_dir: str, per_device: int) -> None:
    """DeepSpeed ZeRO-3 (every parameter partitioned, none kept whole: persistence threshold 0), the step of
    `train_fsdp` through the engine: AdamW (torch's, no weight decay, constant rate), gradients clipped to norm 1;
    rank 0 writes the loss curve (the mean over processes)."""
    import deepspeed

    deepspeed.init_distributed(dist_backend="gloo")
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    config = {
        "train_micro_batch_size_per_gpu": per_device, "gradient_accumulation_steps": 1, "gradient_clipping": 1.0,
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
        "optimizer": {"type": "AdamW", "params": {"lr": LEARNING_RATE, "weight_decay": 0.0, "torch_adam": True}},
    }
    trainable = [param for param in model.parameters() if param.requires_grad]
    engine, *_ = deepspeed.initialize(model=model, model_parameters=trainable, config=config)
    # every parameter partitioned: each process holds a shard (half, padded), the full tensor only while it is used
    assert all(param.ds_tensor.numel() < param.ds_numel for param in model.parameters() if param.ds_numel > 1)
    losses = []
    for step in range(STEPS):
        start = (step * world + rank) * per_device
        loss = engine(**default_data_collator(rows[start : start + per_device])).loss
        engine.backward(loss)
        engine.step()
        logged = loss.detach().clone()
        torch.distributed.all_reduce(logged)
        losses.append(logged.item() / world)
    faulthandler.dump_traceback_later(90, exit=True)
    if rank == 0:
        (Path(output_dir) / "losses.json").write_text(json.dumps(losses))
    leave_distributed()


def leave_distributed() -> None:
    """Every rank waits for rank 0's files (the barrier is bounded by the group's timeout). Then the process leaves with
    os._exit and skips both destroy_process_group and the interpreter's teardown: the first can hang with a small
    probability (pytorch/pytorch#75097; a 2-process run of this script hung after training in CI), the second can
    abort while gloo's threads still run ("terminate called without an active exception": seen once). Nothing is left
    to release: the process ends here, and its files are written and closed."""
    torch.distributed.barrier()
    faulthandler.cancel_dump_traceback_later()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def main() -> None:
    kind, output_dir, per_device = sys.argv[1], sys.argv[2], int(sys.argv[3])
    torch.manual_seed(0)
    model, rows = build(kind)
    if sys.argv[4:] == ["fsdp"]:
        train_fsdp(kind, model, rows, output_dir, per_device)  # ends the process
    if sys.argv[4:] == ["zero3"]:
        Path(output_dir).mkdir(parents=True, exist_ok=True)
        train_zero3(model, rows, output_dir, per_device)  # ends the process
    arguments = TrainingArguments(
        output_dir=output_dir, per_device_train_batch_size=per_device, max_steps=STEPS, learning_rate=LEARNING_RATE,
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
        leave_distributed()  # (the barrier is bounded by ddp_timeout)
    faulthandler.cancel_dump_traceback_later()


if __name__ == "__main__":
    main()
