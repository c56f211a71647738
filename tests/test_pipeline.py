"""Pipeline parallelism (megajax/parallel/pipeline.py): the schedules' tables, parity with one device
for every schedule (loss and grad norm per step, parameters after step 1), composition with the
other axes, memory that does not grow with the microbatches under 1F1B, the compiled program's
transfers, checkpoints across pipeline and non-pipeline meshes, and the errors."""

import re

import jax
import numpy as np
import pytest

from layout_parity import MOE, PARITY, assert_same_run, moe_accumulation_reference, reference, run
from megajax.config import load_config
from megajax.errors import ConfigError, MeshError
from megajax.parallel.pipeline import build_schedule, stage_order
from megajax.perf.fit import compiled_bytes
from megajax.train.loop import train
from megajax.plan import make_plan
from megajax.train.setup import build_setup

# 4 layers so that P = 4, or P = 2 x V = 2, split them. One device with accumulation 4 is the
# reference of every pipeline run (the loss is a mean over the global batch, so the microbatch
# count does not change it).
MODEL = ["model.num_layers=4"]
REFERENCE = [*MODEL, "train.micro_batch=2"]


# ----------------------------------------------------------------------------------------------
# The tables

@pytest.mark.parametrize("name, virtual", [("gpipe", 1), ("1f1b", 1), ("interleaved", 2), ("interleaved", 3)])
@pytest.mark.parametrize("stages", [2, 4])
def test_schedule_tables(name, virtual, stages):
    """Every microbatch runs forward and backward once per chunk and stage, every transfer arrives
    the tick its receiver runs it (check_schedule, run by build_schedule), the bubble is (P - 1) /
    (V M + P - 1), and 1F1B's stash does not grow with M while GPipe's holds every microbatch."""
    stashes = {}
    for m in (stages, 2 * stages, 4 * stages):
        sc = build_schedule(name, stages, m, virtual)
        assert sc.bubble_fraction == pytest.approx((stages - 1) / (virtual * m + stages - 1))
        assert sc.ticks == virtual * m + (virtual + 1) * stages - 2 or name == "gpipe"
        stashes[m] = sc.stash
        for s in range(stages):  # forward first, then backward, of every (chunk, microbatch)
            f = {(c, i): t for t, (c, i) in enumerate(zip(sc.fwd_chunk[:, s], sc.fwd_micro[:, s])) if c >= 0}
            b = {(c, i): t for t, (c, i) in enumerate(zip(sc.bwd_chunk[:, s], sc.bwd_micro[:, s])) if c >= 0}
            assert sorted(f) == sorted(b) == [(c, i) for c in range(virtual) for i in range(m)]
            assert all(b[k] >= f[k] for k in f)
    if name == "gpipe":
        assert stashes == {m: m for m in stashes}
    else:
        assert stashes[2 * stages] == stashes[4 * stages] <= 2 * virtual * stages - 1  # flat in M
    if name == "1f1b":
        assert stashes[4 * stages] == 2 * stages - 1


def test_interleaved_chunks_are_model_chunks_round_the_stages():
    # 8 layers, 2 stages x 2 chunks of 2: stage 0 holds model chunks 0 and 2, stage 1 chunks 1 and 3.
    assert stage_order(8, 2, 2).tolist() == [0, 1, 4, 5, 2, 3, 6, 7]
    assert stage_order(8, 2, 1) is None


# ----------------------------------------------------------------------------------------------
# Parity with one device

CASES = {
    # name: overrides (M = 8 / (micro_batch x data-parallel size))
    "1f1b_p2_m2_data4": ["mesh.pipeline=2", "mesh.data=4", "train.micro_batch=1"],
    "1f1b_p4_m8_tensor2": ["mesh.pipeline=4", "mesh.data=1", "mesh.tensor=2", "train.micro_batch=1"],
    "gpipe_p4_m4_data2": ["mesh.pipeline=4", "mesh.data=2", "train.micro_batch=1",
                          "parallel.pipeline_schedule=gpipe"],
    "gpipe_p2_m4_fsdp2_tensor2": ["mesh.pipeline=2", "mesh.data=1", "mesh.fsdp=2", "mesh.tensor=2",
                                  "train.micro_batch=1", "parallel.pipeline_schedule=gpipe"],
    "interleaved_v2_p2_m2_data2_tensor2": ["mesh.pipeline=2", "mesh.data=2", "mesh.tensor=2", "train.micro_batch=1",
                                           "parallel.pipeline_schedule=interleaved", "parallel.virtual_stages=2"],
    "interleaved_v2_p2_m4_tensor4_sp": ["mesh.pipeline=2", "mesh.data=1", "mesh.tensor=4", "train.micro_batch=2",
                                        "parallel.sequence_parallel=true",
                                        "parallel.pipeline_schedule=interleaved", "parallel.virtual_stages=2"],
    "1f1b_p2_m4_data2_tensor2_sp_distopt_recompute": [
        "mesh.pipeline=2", "mesh.data=2", "mesh.tensor=2", "train.micro_batch=1", "parallel.sequence_parallel=true",
        "parallel.distributed_optimizer=true", "parallel.recompute=full"],
}


@pytest.mark.parametrize("overrides", list(CASES.values()), ids=list(CASES))
def test_pipeline_matches_one_device(small_config, overrides):
    ref = reference(small_config, *REFERENCE)
    got = run(small_config, *MODEL, *overrides, devices=jax.devices())
    assert_same_run(got, ref)


def test_flash_attention_through_the_stages_matches_one_device(small_config):
    """The Pallas flash kernel (interpret mode on CPU) inside 1F1B stages on pipeline 2 x data 4: its
    calls are typed as varying over the stage's axes (pallas_call cannot infer that)."""
    ref = reference(small_config, *REFERENCE, "model.attention_impl=flash")
    got = run(small_config, *MODEL, "mesh.pipeline=2", "mesh.data=4", "train.micro_batch=1",
              "model.attention_impl=flash", devices=jax.devices())
    assert_same_run(got, ref)


def test_context_parallel_stages_match_one_device(small_config):
    """1F1B on pipeline 2 x data 2 x context 2 (all-gathered k/v): the stage loop splits each
    microbatch's sequence over `context` too, the attention's collectives run inside the stage,
    and the gradient sums are reduced over `context` after the loop like a data axis's."""
    ref = reference(small_config, *REFERENCE)
    got = run(small_config, *MODEL, "mesh.pipeline=2", "mesh.data=2", "mesh.context=2", "train.micro_batch=1",
              "parallel.context_impl=allgather", devices=jax.devices())
    assert_same_run(got, ref)


def test_interleaved_four_stages_matches_one_device(small_config):
    """P = 4 x V = 2 chunks of one layer (8 layers): stage s holds model layers s and s + 4."""
    ref = reference(small_config, "model.num_layers=8", "train.micro_batch=2", steps=3)
    got = run(small_config, "model.num_layers=8", "mesh.pipeline=4", "mesh.data=2", "train.micro_batch=1",
              "parallel.pipeline_schedule=interleaved", "parallel.virtual_stages=2", devices=jax.devices(), steps=3)
    assert_same_run(got, ref)


def test_tied_embeddings_and_dropout_match_one_device(small_config):
    """GPT: the tied embedding's gradient comes from the first stage (lookup) and the last (output
    layer), learned positions from the first; dropout draws the masks one device draws."""
    gpt = ["model.family=gpt", "model.hidden_dropout=0.1", "model.attention_dropout=0.1"]
    ref = reference(small_config, *REFERENCE, *gpt, steps=3, params=False)
    got = run(small_config, *MODEL, *gpt, "mesh.pipeline=2", "mesh.data=1", "mesh.fsdp=2", "mesh.tensor=2",
              "train.micro_batch=1", devices=jax.devices(), steps=3, params=False)
    assert_same_run(got, ref, params=False)


@pytest.mark.parametrize("precision", [["train.precision=fp16", "train.initial_loss_scale=1024"]], ids=["fp16"])
def test_half_precision_trains_like_one_device(small_config, precision):
    """fp16 through the stages (activations and cotangents sent in 16 bits, as bf16's are): within the
    bf16 tolerances of tests/test_parity.py; the loss scale seeds every microbatch's backward and
    makes one decision per step, as on one device. (bf16 through the stages: the FP8 runs of
    tests/test_fp8_training.py compute in bf16.)"""
    ref = reference(small_config, *REFERENCE, *precision, steps=3, params=False)
    got = run(small_config, *MODEL, *precision, "mesh.pipeline=2", "mesh.data=4", "train.micro_batch=1",
              devices=jax.devices(), steps=3, params=False)
    assert_same_run(got, ref, rtol=2.0 ** -8 / 16, grad_norm_rtol=2.0 ** -8, params=False)


@pytest.mark.parametrize("model, overrides", [
    (["model.moe_shared_expert_ffn_size=96"], ["mesh.pipeline=2", "mesh.data=2", "mesh.expert=2"]),
    (["model.moe_router_score_function=sigmoid", "model.moe_router_bias_update_rate=0.01",
      "model.moe_router_topk_scaling_factor=2.0", "model.moe_router_num_groups=4", "model.moe_router_group_topk=2"],
     ["mesh.pipeline=2", "mesh.data=1", "mesh.expert=4", "parallel.pipeline_schedule=interleaved",
      "parallel.virtual_stages=2"]),
], ids=["1f1b_p2_m2_data2_expert2_shared_expert", "interleaved_v2_p2_m2_expert4_sigmoid_expert_bias"])
def test_mixture_of_experts_through_the_stages_matches_one_device(small_config, model, overrides):
    """MoE layers inside the stages: tokens cross `expert` by all-to-all within a stage, each chunk's
    balancing and z losses (over the whole microbatch, all data shards' counts) join the objective
    in its backward; one device with the same microbatches (4 sequences, 2 per step) is the reference.
    The expert bias (interleaved case) reaches each chunk's layers in their stage order and moves by
    the step's token counts of every layer (compared after the run by assert_same_run)."""
    ref = moe_accumulation_reference(small_config, *model)  # MODEL's 4 layers
    got = run(small_config, *MODEL, *MOE, *model, *overrides, "train.micro_batch=1", devices=jax.devices(), steps=3)
    assert_same_run(got, ref)


# ----------------------------------------------------------------------------------------------
# Memory and transfers, read off the compiled step

def _compiled(*overrides, devices: int = 2, with_setup: bool = False):
    cfg = load_config(overrides=["model.num_layers=4", "model.hidden_size=128", "model.num_heads=4",
                                 "model.ffn_hidden_size=256", "train.seq_len=256", "train.micro_batch=1",
                                 *overrides])
    setup = build_setup(make_plan(cfg, devices), jax.devices()[:devices])
    shape = setup.batch.shape
    batch = {k: jax.ShapeDtypeStruct(shape, np.float32 if k == "loss_mask" else np.int32, sharding=s)
             for k, s in setup.batch_shardings.items()}
    ok = jax.ShapeDtypeStruct((), np.bool_, sharding=jax.sharding.NamedSharding(setup.mesh, jax.sharding.PartitionSpec()))
    compiled = setup.train_step().lower(setup.target(), batch, ok).compile()
    return (compiled, setup) if with_setup else compiled


def test_data_parallel_gradients_are_reduced_once_per_step():
    """Pipeline 2 x data 4, 4 microbatches: each data shard keeps its own gradient sums through the
    stage loop and the step all-reduces them once (the analytic minimum: the local stage's
    gradient plus the embedding's and output layer's over `pipeline`), not once per microbatch."""
    from megajax.perf.bench import communication_table
    compiled, setup = _compiled("mesh.pipeline=2", "mesh.data=4", "train.global_batch=16", devices=8,
                                with_setup=True)
    assert setup.batch.accumulation == 4
    comm = communication_table(setup.plan, compiled, setup.spec)
    assert 0.9 <= comm["all-reduce"]["ratio"] <= 1.05, comm
    assert comm["collective-permute"]["bytes"] > 0


def test_1f1b_temporaries_stay_flat_while_gpipe_grows():
    temps = {}
    for name in ("1f1b", "gpipe"):
        for m in (4, 16):
            compiled = _compiled("mesh.pipeline=2", "mesh.data=1", f"train.global_batch={m}",
                                 f"parallel.pipeline_schedule={name}")
            temps[name, m] = compiled_bytes(compiled)["temporaries"]
    # One microbatch's stage input: 256 tokens x 128 x 4 bytes = 128 KiB; GPipe stashes 16 of them.
    stage_input = 256 * 128 * 4
    assert temps["gpipe", 16] - temps["gpipe", 4] >= 10 * stage_input, temps
    assert temps["1f1b", 16] <= temps["1f1b", 4] + stage_input, temps
    assert temps["1f1b", 16] < temps["gpipe", 16] - 8 * stage_input, temps


@pytest.mark.parametrize("stages, layout", [(4, ["mesh.data=2"]),
                                           (2, ["mesh.tensor=2", "mesh.context=2", "parallel.sequence_parallel=true",
                                                "parallel.context_impl=allgather"])],
                         ids=["p4_data2", "p2_tensor2_context2_sp"])
def test_the_step_permutes_activations_and_never_gathers_layer_weights(stages, layout):
    compiled, setup = _compiled(f"mesh.pipeline={stages}", "mesh.data=1", *layout, "train.global_batch=8", devices=8,
                                with_setup=True)
    text = compiled.as_text()
    assert len(re.findall(r"collective-permute(-start)?\(", text)) >= 2
    # Devices are numbered pipeline-major (stage = id // per): an all-gather over `pipeline` would have a
    # replica group holding two stages' devices. Layer weights stay on their stage; the all-gathers of
    # tensor, sequence and context parallelism stay inside one. Only the ends (the embedding and output
    # layer, kept split over the stages between steps) are gathered over `pipeline`: [vocab (/ tensor), h].
    per = 8 // stages
    vocab = {setup.plan.padded_vocab, setup.plan.padded_vocab // setup.plan.sizes["tensor"]}
    gathers = ends = 0
    for line in text.splitlines():
        result = re.search(r"=\s*f32\[(\d+),(\d+)\][^ ]* all-gather", line)
        if result and sorted(map(int, result.groups())) in ([128, v] for v in vocab):
            ends += 1
            continue
        if re.search(r"all-gather(-start)?\(", line):
            gathers += 1
            groups = re.search(r"replica_groups=\{(\{[\d,]+\}(?:,\{[\d,]+\})*)\}", line)
            iota = re.search(r"replica_groups=\[(\d+),(\d+)\]<=\[(\d+)\](T\([\d,]+\))?", line)
            if groups:
                for g in re.findall(r"\{([\d,]+)\}", groups.group(1)):
                    assert len({int(d) // per for d in g.split(",")}) == 1, line
            else:
                assert iota is not None and iota.group(4) is None and int(iota.group(2)) <= per, line
    assert gathers > 0 or stages == 4
    assert ends == 2  # llama: the embedding table [vocab, h] and the output layer [h, vocab]


# ----------------------------------------------------------------------------------------------
# Checkpoints, validation



def test_pipeline_checkpoint_resumes_without_pipeline_and_back(small_config, tmp_path):
    """2 steps on pipeline 2 x data 4, then step 3 on data 8 without a pipeline, and, from the
    one-device run's step 2, step 3 on the pipeline: both equal one device's step 3."""
    ref = reference(small_config, *REFERENCE)  # the parity tests' run: its schedule (PARITY) ignores train.steps
    pp = ["mesh.pipeline=2", "mesh.data=4", "train.micro_batch=1"]
    a = str(tmp_path / "a")
    train(small_config(*MODEL, *pp, *PARITY, f"train.run_dir={a}", "checkpoint.every=2", steps=2),
          devices=jax.devices())
    resumed = train(small_config(*MODEL, "mesh.data=8", "train.micro_batch=1", *PARITY,
                                 f"train.run_dir={a}", steps=3), devices=jax.devices())
    b = str(tmp_path / "b")
    train(small_config(*REFERENCE, *PARITY, f"train.run_dir={b}", "checkpoint.every=2", steps=2),
          devices=jax.devices()[:1])
    back = train(small_config(*MODEL, *pp, *PARITY, f"train.run_dir={b}", steps=3),
                 devices=jax.devices())
    np.testing.assert_allclose(resumed.losses[-1], ref.losses[2], rtol=1e-5)
    np.testing.assert_allclose(back.losses[-1], ref.losses[2], rtol=1e-5)


def test_validation_on_a_pipeline_mesh_matches_one_device(small_config):
    common = [*MODEL, "train.eval_every=2", "train.eval_steps=1"]
    ref = train(small_config(*common, "train.micro_batch=2", steps=2), devices=jax.devices()[:1])
    got = train(small_config(*common, "mesh.pipeline=2", "mesh.data=4", "train.micro_batch=1", steps=2),
                devices=jax.devices())
    assert ref.val_losses and [s for s, _ in got.val_losses] == [s for s, _ in ref.val_losses]
    np.testing.assert_allclose([v for _, v in got.val_losses], [v for _, v in ref.val_losses], rtol=1e-5)


# ----------------------------------------------------------------------------------------------
# Errors

@pytest.mark.parametrize("overrides, error, message", [
    (["model.num_layers=6", "mesh.pipeline=4", "train.micro_batch=1"], MeshError,
     r"model.num_layers=6 does not split into mesh.pipeline=4 stages x parallel.virtual_stages=1.*use mesh.pipeline=2 or "
     r"model.num_layers=4 or model.num_layers=8"),
    (["model.num_layers=4", "mesh.pipeline=2", "parallel.pipeline_schedule=interleaved", "parallel.virtual_stages=4",
      "train.micro_batch=1"], MeshError,
     r"model.num_layers=4 does not split into mesh.pipeline=2 stages x parallel.virtual_stages=4"),
    (["model.num_layers=4", "mesh.pipeline=4", "mesh.data=2"], MeshError,
     r"needs at least as many microbatches as stages; this run has 1 \(train.global_batch=8 / "
     r"\(train.micro_batch=4 x data-parallel size 2\)\)"),
    (["model.num_layers=4", "mesh.pipeline=2", "train.micro_batch=2"], MeshError,
     r"at least as many microbatches as stages; this run has 1"),
    (["model.num_layers=4", "mesh.pipeline=2", "train.micro_batch=2", "train.global_batch=24",
      "parallel.pipeline_schedule=interleaved", "parallel.virtual_stages=2"], MeshError,
     r"a multiple of mesh.pipeline=2 microbatches .* this run has 3 .* train.global_batch=32"),
    (["parallel.virtual_stages=2"], ConfigError, r"parallel.virtual_stages = 2 needs parallel.pipeline_schedule=interleaved"),
    (["parallel.pipeline_schedule=interleaved", "parallel.virtual_stages=2"], ConfigError,
     r"parallel.virtual_stages = 2 needs pipeline parallelism"),
])
def test_bad_pipeline_settings_are_clear_errors(small_config, overrides, error, message):
    with pytest.raises(error, match=message):
        make_plan(small_config(*overrides), 8)


def test_cluster_preset_plans_and_the_analytic_memory_counts_the_schedule():
    """configs/mesh/4x8-gpu-pp.yaml (pipeline 4 across nodes, tensor 8 + SP inside) plans a Llama 3 8B
    on 32 GPUs; `--topology`'s analytic activations hold one chunk's layers plus the stash: 1F1B's
    stays bounded while GPipe's grows with the microbatches."""
    from megajax.perf.bench import topology_estimate
    common = ["model/llama3-8b", "mesh/4x8-gpu-pp"]
    over = ["train.seq_len=4096", "train.precision=bf16"]
    plan = make_plan(load_config(common, [*over, "train.global_batch=64"]), 32)
    assert plan.sizes["pipeline"] == 4 and plan.sizes["tensor"] == 8 and plan.batch.accumulation == 64
    act = {(s, g): topology_estimate(load_config(common, [*over, f"train.global_batch={g}",
                                                          f"parallel.pipeline_schedule={s}"]),
                                     "32xH100")["analytic"]["activations"]
           for s in ("1f1b", "gpipe") for g in (16, 64)}
    assert act["1f1b", 16] == act["1f1b", 64] < act["gpipe", 16] < act["gpipe", 64]
