"""The pipeline's ends: only the first stage runs the embedding and only the last the output layer, so
the stages keep one copy of them (and of their Adam state) split among them between steps
(megajax.mesh.vocab_storage_axes), gather it for the step and reduce-scatter its gradient back; a
tied embedding serves both ends from that copy, its gradient the sum of both ends' (Megatron's
--share-embeddings-and-output-weights). Per-device bytes by stage against the analytic count, the
compiled step's, its collectives, and runs equal to one device."""

import math

import jax
import numpy as np
import optax
import pytest
from flax.traverse_util import flatten_dict

from layout_parity import assert_same_run, reference, run
from megajax.config import load_config
from megajax.mesh import make_rules, vocab_storage_axes
from megajax.perf.analytic import memory_estimate
from megajax.perf.bench import communication_table
from megajax.perf.fit import compiled_bytes
from megajax.plan import make_plan
from megajax.train.setup import build_setup

SMALL = ["model.num_layers=4", "model.hidden_size=128", "model.num_heads=4", "model.ffn_hidden_size=256",
         "train.seq_len=128", "train.micro_batch=1", "train.global_batch=16"]
ENDS = ("embed", "output")  # the embedding table and the (untied) output layer


def _bytes_by_device(shardings, abstract, keep=lambda path: True) -> dict[int, int]:
    """Bytes of the arrays of a state (its shardings and abstract values) each device holds."""
    out: dict[int, int] = {}
    values = flatten_dict(abstract)
    for path, sharding in flatten_dict(shardings).items():
        if not keep(path):
            continue
        x = values[path]
        for device, index in sharding.devices_indices_map(x.shape).items():
            n = math.prod(len(range(*s.indices(d))) for s, d in zip(index, x.shape))
            out[device.id] = out.get(device.id, 0) + n * x.dtype.itemsize
    return out


@pytest.mark.parametrize("layout", [
    ["mesh.pipeline=2", "mesh.data=4"],
    ["mesh.pipeline=4", "mesh.data=2", "model.family=gpt"],  # a tied embedding
    ["mesh.pipeline=2", "mesh.tensor=2", "mesh.data=2", "parallel.distributed_optimizer=true"],
], ids=["p2_data4", "p4_data2_tied", "p2_tensor2_data2_distopt"])
def test_every_stage_holds_a_share_of_the_ends(layout):
    """A device of every stage holds 1 / (stages x tensor) of the embedding and output layer and of
    their Adam moments (where each stage held them whole before); every device's parameter and Adam
    bytes are the analytic count (megajax bench, the planner, the fit check), stage by stage."""
    cfg = load_config(overrides=[*SMALL, *layout])
    plan = make_plan(cfg, 8)
    stages, tensor = plan.sizes["pipeline"], plan.sizes["tensor"]
    assert plan.rules.params["vocab"] == ("tensor", "pipeline") and plan.rules.activations["vocab"] == ("tensor",)
    setup = build_setup(plan, jax.devices())
    state, abstract = setup.state_shardings, setup.abstract_state
    ends = lambda path: path[0] in ENDS
    whole = sum(x.size * x.dtype.itemsize for p, x in flatten_dict(abstract.params).items() if ends(p))
    assert whole == plan.padded_vocab * cfg.model.hidden_size * 4 * (1 if cfg.model.tie_embeddings else 2)
    est = memory_estimate(plan, setup.spec)
    params = _bytes_by_device(state.params, abstract.params)
    end_bytes = _bytes_by_device(state.params, abstract.params, ends)
    is_adam = lambda x: isinstance(x, optax.ScaleByAdamState)
    adam = [(s, a) for s, a in zip(jax.tree.leaves(state.opt_state, is_leaf=is_adam),
                                   jax.tree.leaves(abstract.opt_state, is_leaf=is_adam)) if is_adam(a)]
    assert len(adam) == 1
    (s, a), = adam
    mu, nu = _bytes_by_device(s.mu, a.mu), _bytes_by_device(s.nu, a.nu)
    by_stage = {}
    for stage in range(stages):
        for device in setup.mesh.devices[stage].flat:
            assert end_bytes[device.id] == whole // (stages * tensor)
            assert params[device.id] == est["params"], (stage, params[device.id], est["params"])
            assert mu[device.id] + nu[device.id] == est["optimizer"], (stage, mu[device.id] + nu[device.id], est)
            by_stage.setdefault(stage, set()).add(params[device.id] + mu[device.id] + nu[device.id])
    assert len(set.union(*by_stage.values())) == 1, by_stage  # every stage holds the same bytes


def test_the_compiled_step_takes_the_analytic_state_and_reduce_scatters_the_ends():
    """Pipeline 2 x data 4: the compiled step's arguments per device are the analytic parameters and
    Adam state plus the batch and the step count; the ends are gathered over `pipeline` before the
    stage loop and their gradients reduce-scattered back, every collective kind within 0.9 - 1.1 of
    the analytic figure."""
    cfg = load_config(overrides=[*SMALL, "mesh.pipeline=2", "mesh.data=4"])
    plan = make_plan(cfg, 8)
    setup = build_setup(plan, jax.devices())
    batch = {k: jax.ShapeDtypeStruct(setup.batch.shape, np.float32 if k == "loss_mask" else np.int32, sharding=s)
             for k, s in setup.batch_shardings.items()}
    ok = jax.ShapeDtypeStruct((), np.bool_, sharding=jax.sharding.NamedSharding(setup.mesh, jax.sharding.PartitionSpec()))
    compiled = setup.train_step().lower(setup.target(), batch, ok).compile()
    est = memory_estimate(plan, setup.spec)
    batch_bytes = sum(math.prod(setup.batch.shape) * 4 for _ in batch) // plan.batch.data_parallel
    arguments = compiled_bytes(compiled)["arguments"]
    assert 0 <= arguments - (est["params"] + est["optimizer"] + batch_bytes) <= 64, (arguments, est)
    comm = communication_table(plan, compiled, setup.spec)
    assert comm["reduce-scatter"]["bytes"] > 0 and comm["all-gather"]["bytes"] > 0, comm
    for kind, row in comm.items():
        assert row["ratio"] is None or 0.9 <= row["ratio"] <= 1.1, (kind, row)


def test_a_vocabulary_the_stages_do_not_divide_stays_whole():
    """A padded vocabulary that pipeline x tensor does not divide keeps the ends whole over `pipeline`
    (the run is not refused): 257 tokens padded to a multiple of 1 over 2 stages."""
    cfg = load_config(overrides=[*SMALL, "mesh.pipeline=2", "model.vocab_size=257",
                                 "model.make_vocab_size_divisible_by=1"])
    assert vocab_storage_axes(cfg, {"pipeline": 2, "tensor": 1}) == ("tensor",)
    assert make_plan(cfg, 8).rules.params["vocab"] == ("tensor",)
    assert vocab_storage_axes(cfg, {"pipeline": 1, "tensor": 1}) == ("tensor",)
    cfg = load_config(overrides=[*SMALL, "mesh.pipeline=2", "model.vocab_size=256"])
    assert make_rules(cfg, {"pipeline": 2, "tensor": 2}).params["vocab"] == ("tensor", "pipeline")


def test_tied_embedding_over_four_stages_matches_one_device(small_config):
    """GPT's tied embedding on pipeline 4 x data 2 (1F1B): the lookup on the first stage and the output
    layer on the last use the one gathered copy, its gradient the sum of both ends' reduce-scattered
    onto the stages' shares; loss and grad norm per step and every parameter after step 1 equal one
    device's (fp32)."""
    gpt = ["model.family=gpt", "model.num_layers=4"]
    ref = reference(small_config, *gpt, "train.micro_batch=2")
    got = run(small_config, *gpt, "mesh.pipeline=4", "mesh.data=2", "train.micro_batch=1", devices=jax.devices())
    assert_same_run(got, ref)
