"""Lowers the train step of shipped recipes for their own mesh, without their hardware (used by
test_composition.py):

    python recipe_lowering_worker.py DEVICES RECIPE [RECIPE ...]

Runs on DEVICES simulated CPU devices (the recipe's device count): plans each recipe, builds its
mesh, model spec and state shardings (abstract: nothing is allocated) and lowers the jitted train
step for CUDA from abstract arguments, printing one JSON line per recipe. cuDNN's attention lowers
to its custom call after its version check, which needs a GPU, is answered here; nothing runs.
"""

import json
import os
import sys

os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={int(sys.argv[1])}"
os.environ["JAX_PLATFORMS"] = "cpu"

import jax  # noqa: E402
import numpy as np  # noqa: E402
from jax._src.cudnn import fused_attention_stablehlo as cudnn  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

import megajax.train.setup as setup_module  # noqa: E402
from megajax.config import load_config  # noqa: E402
from megajax.plan import make_plan  # noqa: E402
from megajax.train.setup import build_setup  # noqa: E402

cudnn.check_cudnn_version = lambda: 90800
setup_module.check_kernel_platform = lambda impl, platform: None  # lowering for CUDA, not running here


def lower(recipe: str) -> dict:
    plan = make_plan(load_config([recipe]), jax.device_count())
    setup = build_setup(plan)
    batch = {k: jax.ShapeDtypeStruct(setup.batch.shape, np.float32 if k == "loss_mask" else np.int32, sharding=s)
             for k, s in setup.batch_shardings.items()}
    ok = jax.ShapeDtypeStruct((), np.bool_, sharding=NamedSharding(setup.mesh, P()))
    text = setup.train_step().trace(setup.target(), batch, ok).lower(lowering_platforms=("cuda",)).as_text()
    return {"recipe": recipe, "mesh": plan.sizes, "pipeline": None if plan.pipeline is None else vars(plan.pipeline),
            "precision": plan.cfg.train.precision, "cudnn_calls": text.count("__cudnn$fmha"),
            "fp8_operands": text.count("f8E4M3FN"), "shard_map": text.count("sdy.manual_computation")}


if __name__ == "__main__":
    for recipe in sys.argv[2:]:
        print(json.dumps(lower(recipe)), flush=True)
