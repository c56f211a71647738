"""`megajax plan` and `megajax bench --topology` with uneven pipeline layouts (megajax/pipeline_layout.py):
the fit check holds every stage to the longest stage's rows (the compiled step's arguments agree), the
step estimate is paced by the slowest stage, the planner offers Megatron's balanced split where the layers
alone do not divide (Llama 3.1 405B's 126 layers in TP 8 x CP 2 x PP 8 x VP 8, Megatron-Bridge's recipe),
and the published recipes fit their 1,024 H100s."""

from __future__ import annotations

import math

import jax
import numpy as np
import pytest

from conftest import SMALL
from megajax.config import load_config
from megajax.perf import analytic, planner
from megajax.perf.bench import topology_estimate
from megajax.perf.fit import compiled_bytes
from megajax.plan import make_plan
from megajax.train.setup import build_setup
from megajax.train.state import build_model_spec


@pytest.mark.parametrize("first", [1, 4])
def test_the_fit_check_holds_the_longest_stage_as_the_compiled_step_does(first):
    """8 layers at pipeline 2 x data 4, the first stage 1 (1 + 7: every stage holds 7 rows) or 4 (the even
    4 + 4): the compiled step's arguments per device are the analytic parameters and Adam state (the
    stage form's rows) plus the batch and the step count."""
    cfg = load_config(overrides=[*SMALL, "model.num_layers=8", "mesh.pipeline=2", "mesh.data=4", "train.micro_batch=1",
                                 f"parallel.first_pipeline_stage_layers={first}"])
    plan = make_plan(cfg, 8)
    setup = build_setup(plan, jax.devices())
    batch = {k: jax.ShapeDtypeStruct(setup.batch.shape, np.float32 if k == "loss_mask" else np.int32, sharding=s)
             for k, s in setup.batch_shardings.items()}
    ok = jax.ShapeDtypeStruct((), np.bool_, sharding=jax.sharding.NamedSharding(setup.mesh, jax.sharding.PartitionSpec()))
    compiled = setup.train_step().lower(setup.target(), batch, ok).compile()
    est = analytic.memory_estimate(plan, setup.spec)
    batch_bytes = sum(math.prod(setup.batch.shape) * 4 for _ in batch) // plan.batch.data_parallel
    arguments = compiled_bytes(compiled)["arguments"]
    assert 0 <= arguments - (est["params"] + est["optimizer"] + batch_bytes) <= 64, (arguments, est)
    if first == 1:  # 7 rows a stage where the even split holds 4: the layers' state grows by 7 / 4
        even = load_config(overrides=[*SMALL, "model.num_layers=8", "mesh.pipeline=2", "mesh.data=4", "train.micro_batch=1"])
        plan4 = make_plan(even, 8)
        est4 = analytic.memory_estimate(plan4, build_model_spec(plan4.cfg, plan4.padded_vocab)[0])
        assert est["params"] > est4["params"] and est["activations"] == pytest.approx(est4["activations"] * 7 / 4,
                                                                                        rel=0.05)


def _estimate(*overrides: str) -> planner.Candidate:
    cfg = load_config(["model/llama3-8b"], ["train.global_batch=64", "train.micro_batch=1", "mesh.tensor=4",
                                             "mesh.pipeline=2", "mesh.data=1", "parallel.recompute=full",
                                             *overrides])
    return planner.estimate(cfg, "8xH100")


def test_the_step_estimate_is_paced_by_the_slowest_stage():
    """Llama 3 8B (32 layers) at tensor 4 x pipeline 2: the even split's last stage carries the output
    layer and loss; giving the first stage 20 layers makes it the slowest, by its 20 of the layers' 32
    against the even share: the `slowest stage` term is compute x (20 / mean - 1) where the mean stage
    holds 16 layers and half the output layer."""
    even, uneven = _estimate(), _estimate("parallel.first_pipeline_stage_layers=20")
    assert 0 < even.parts["slowest stage"] < uneven.parts["slowest stage"]
    assert uneven.step_seconds > even.step_seconds and uneven.layout == "Et*20|t*12L" and even.layout == ""
    m = load_config(["model/llama3-8b"]).model
    layer = 6 * (m.hidden_size * (m.num_heads + 2 * m.num_kv_heads) * m.head_dim + m.num_heads * m.head_dim
                 * m.hidden_size + 3 * m.hidden_size * m.ffn_hidden_size) + 6 * 8192 * m.num_heads * m.head_dim
    head = 6 * m.hidden_size * 128256
    compute = uneven.parts["compute"] + uneven.parts["memory-bound"]
    expected = compute * (20 * layer / ((32 * layer + head) / 2) - 1)
    assert uneven.parts["slowest stage"] == pytest.approx(expected, rel=0.02)


def test_the_planner_offers_the_balanced_split_megatron_bridge_runs_for_llama_405b():
    """Llama 3.1 405B's 126 layers on 1,024 H100s with tensor 8 x context 2 pinned: the planner estimates
    pipeline 8 x 8 virtual stages with the embedding and the loss counted as layers (64 chunks of 2, the
    first and last of 1), recipes/llama3.1-405b-1024xh100's layout, to the recipe's own estimate."""
    cfg = load_config(["model/llama3.1-405b"], ["train.global_batch=512", "train.micro_batch=1",
                                                "model.attention_impl=cudnn", "mesh.tensor=8", "mesh.context=2",
                                                "parallel.recompute=full"])
    report = planner.plan_cluster(cfg, "1024xH100", top=3, keep=("train.micro_batch", "parallel.recompute"))
    published = [c for c in report["ranked"] if c.sizes["pipeline"] == 8 and c.sizes["data"] == 8
                 and c.parallel["virtual_stages"] == 8 and c.parallel.get("account_for_loss_in_pipeline_split")]
    assert len(published) == 1, [c.label() for c in published]  # (without the distributed optimizer: too big)
    c = published[0]
    assert c.parallel["distributed_optimizer"] and c.fits
    assert c.layout == "Et|(tt|)*62tL" and "embedding and loss counted as layers" in c.label()
    recipe = planner.estimate(load_config(["recipes/llama3.1-405b-1024xh100"]), "1024xH100")
    assert recipe.layout == c.layout and recipe.step_seconds == pytest.approx(c.step_seconds, rel=1e-9)
    assert not any(c.sizes["pipeline"] == 8 and c.parallel["virtual_stages"] == 8
                   and not c.parallel.get("account_for_loss_in_pipeline_split") for c in report["ranked"])


@pytest.mark.parametrize("recipe", ["recipes/llama3.1-405b-1024xh100", "recipes/llama3.1-405b-1024xh100-fp8",
                                    "recipes/deepseek-v3-1024xh100"])
def test_the_published_recipes_fit_their_1024_h100s(recipe):
    cfg = load_config([recipe])
    r = topology_estimate(cfg, "1024xH100")
    assert r["fits"], r
    plan = make_plan(cfg, 1024)
    if "deepseek" in recipe:
        assert plan.pipeline.chunks == (3, *(2,) * 29, 0, 0) and plan.sizes["expert"] == 64
    else:
        assert plan.pipeline.chunks == (1, *(2,) * 62, 1) and plan.sizes["context"] == 2


def test_the_405b_preset_has_the_published_parameter_count():
    plan = make_plan(load_config(["model/llama3.1-405b"]), 1)
    spec, _ = build_model_spec(plan.cfg, plan.padded_vocab, mesh=None, rules=None)
    assert sum(math.prod(x.shape) for x in jax.tree.leaves(spec.abstract_params)) == 405_853_388_800


def test_the_nemotron_h_56b_preset_splits_its_irregular_pattern_unevenly():
    """Nemotron-H 56B's 118 layers (a pattern without a repeating group) at pipeline 8: refused by the
    even split, split 14 + 6 x 15 + 14 with the embedding and the loss counted as layers."""
    from megajax.errors import MeshError
    base = ["mesh.pipeline=8", "mesh.tensor=8", "mesh.data=1", "train.global_batch=64", "train.micro_batch=1"]
    plan = make_plan(load_config(["model/nemotron-h-56b"]), 1)
    spec, _ = build_model_spec(plan.cfg, plan.padded_vocab, mesh=None, rules=None)
    assert 56.0e9 < sum(math.prod(x.shape) for x in jax.tree.leaves(spec.abstract_params)) < 56.5e9
    assert len(plan.cfg.model.hybrid_pattern()) == 118
    with pytest.raises(MeshError, match="parallel.pipeline_layout"):
        make_plan(load_config(["model/nemotron-h-56b"], base), 64)
    balanced = make_plan(load_config(["model/nemotron-h-56b"], [*base, "parallel.account_for_embedding_in_pipeline_split=true",
                                                                "parallel.account_for_loss_in_pipeline_split=true"]), 64)
    assert balanced.pipeline.chunks == (14, *(15,) * 6, 14)


def test_the_planner_offers_deepseek_v3s_published_layout():
    """DeepSeek-V3 on 1,024 H100s at expert 64 x pipeline 8 (pinned): among the candidates, 4 virtual
    stages with the embedding and the 3 dense layers alone in the first chunk, 2 MoE layers a chunk and
    the loss alone in the last (Megatron's published layout), estimated as recipes/deepseek-v3-1024xh100
    is; the even split cannot place 58 MoE layers in 8 x 4 chunks."""
    cfg = load_config(["model/deepseek-v3"], ["mesh.expert=64", "mesh.pipeline=8", "train.global_batch=8192",
                                              "train.micro_batch=1", "parallel.recompute=full"])
    report = planner.plan_cluster(cfg, "1024xH100", top=50, keep=("train.micro_batch", "parallel.recompute"))
    found = [c for c in report["ranked"] if c.layout == "Et*3|(tt|)*29|L"]
    assert found and all(c.parallel["virtual_stages"] == 4 for c in found)
    # (the recipe's data 2 with the distributed optimizer needs 73.8 GiB, over the plan's 72: FSDP 2 fits)
    c = next(c for c in found if c.sizes["fsdp"] == 2 and c.sizes["tensor"] == 1)
    recipe = planner.estimate(load_config(["recipes/deepseek-v3-1024xh100"], [
        "mesh.dcn.data=1", "mesh.dcn.fsdp=2", "parallel.distributed_optimizer=false"]), "1024xH100")
    assert recipe.layout == c.layout and recipe.step_seconds == pytest.approx(c.step_seconds, rel=1e-9)
    assert recipe.memory["total"] == c.memory["total"]
    # the report says what ranks each alternative below the first: its parts that exceed the first's most
    best = report["ranked"][0]
    for axis, alt in report["alternatives"].items():
        worst = max(alt.parts, key=lambda k: alt.parts[k] - best.parts.get(k, 0.0) if "overlapped" not in k else -1e9)
        assert planner.behind(alt, best).startswith(worst + " +")
        assert f"behind #1 by {planner.behind(alt, best)}" in planner.format_plan(report).split("not chosen")[1]
    assert report["alternatives"], "expected a parallelism the first layout leaves out"
