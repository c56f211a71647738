"""One tensor-parallel rank of Megatron-Core's GPTModel saving or loading a torch_dist checkpoint with
megatron-core's own dist_checkpointing, on CPU over gloo (used by test_torch_dist.py).

    python megatron_dist_worker.py save TOKENS.npy RANK WORLD PORT LEGACY_STEP_DIR SAVE_DIR [LEGACY SAVE ...]
    python megatron_dist_worker.py load STEP_DIR TOKENS.npy OUT.npy RANK WORLD PORT

save: for each pair, builds GPTModel (local spec) from a legacy checkpoint's args at TP = WORLD, loads
that rank's legacy file, saves its logits on TOKENS as SAVE_DIR/logits.npy and writes SAVE_DIR/iter_{iteration:07d} with dist_checkpointing.save (the common
state `args`, `checkpoint_version`, `iteration` going to common.pt, as Megatron-LM up to
megatron-core 0.18 writes it) and SAVE_DIR/latest_checkpointed_iteration.txt.

load: builds GPTModel at TP = WORLD from the args of a torch_dist step directory (common.pt or the
common state dist_checkpointing.load_common_state_dict finds), fills it with
dist_checkpointing.load(model.sharded_state_dict(), STEP_DIR) and saves rank 0's logits.
"""

import os
import sys

import torch
import torch.distributed as dist

from megatron_worker import build_model, init, save_logits


def save(legacy_step, save_dir, tokens_file, rank, world):
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.strategies.torch import TorchDistSaveShardedStrategy
    name = f"mp_rank_{rank:02d}"
    saved = torch.load(os.path.join(legacy_step, name, "model_optim_rng.pt"), weights_only=False)
    args = saved["args"]
    assert args.tensor_model_parallel_size == world and args.pipeline_model_parallel_size == 1, args
    model = build_model(args, world, 1, 0)
    model.load_state_dict({k: v.float() if isinstance(v, torch.Tensor) else v for k, v in saved["model"].items()},
                          strict=True)
    save_logits([model.eval()], tokens_file, os.path.join(save_dir, "logits.npy"), rank)
    iteration = int(saved["iteration"]) or 1
    step = os.path.join(save_dir, f"iter_{iteration:07d}")
    if rank == 0:
        os.makedirs(step)
    dist.barrier()
    state = {"model": model.sharded_state_dict(), "args": args, "checkpoint_version": 3.0, "iteration": iteration}
    # One writer thread: more spawn writer processes, which outlive the worker holding its output pipes.
    dist_checkpointing.save(state, step, TorchDistSaveShardedStrategy("torch_dist", 1, thread_count=1))
    if rank == 0:
        with open(os.path.join(save_dir, "latest_checkpointed_iteration.txt"), "w") as f:
            f.write(str(iteration))
    dist.barrier()


def load(step, tokens_file, out_file, rank, world, port):
    init(rank, world, port)
    from megatron.core import dist_checkpointing
    common = dist_checkpointing.load_common_state_dict(step)
    args = common["args"]
    args.tensor_model_parallel_size, args.pipeline_model_parallel_size = world, 1
    model = build_model(args, world, 1, 0)
    state = dist_checkpointing.load({"model": model.sharded_state_dict()}, step)
    model.load_state_dict({k: v.float() if isinstance(v, torch.Tensor) else v for k, v in state["model"].items()},
                          strict=True)
    save_logits([model.eval()], tokens_file, out_file, rank)


if __name__ == "__main__":
    mode, *rest = sys.argv[1:]
    if mode == "save":
        toks, rank, world, port, *pairs = rest
        init(int(rank), int(world), int(port))
        for legacy, out in zip(pairs[::2], pairs[1::2]):
            if int(rank) == 0:
                os.makedirs(out)
            dist.barrier()
            save(legacy, out, toks, int(rank), int(world))
    else:
        step, toks, out, rank, world, port = rest
        load(step, toks, out, int(rank), int(world), int(port))
    import multiprocessing
    for child in multiprocessing.active_children():  # dist_checkpointing's writer process, else orphaned
        child.terminate()
        child.join(10)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
