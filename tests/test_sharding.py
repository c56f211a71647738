"""Compiled-step structure: SP collectives, and shardings equal to the rules tables."""

import re

import jax
import pytest
from jax.sharding import NamedSharding

from megajax.mesh import logical_to_spec
from megajax.train.loop import build_trainer

COLLECTIVE = re.compile(r"=\s*(.*?)\s(all-reduce|all-gather|reduce-scatter)(?:-start)?\(")


def collectives(hlo: str) -> dict[str, list[tuple[int, ...]]]:
    """Result shapes of each collective kind in compiled HLO text (tuple results flattened)."""
    out: dict[str, list] = {"all-reduce": [], "all-gather": [], "reduce-scatter": []}
    for line in hlo.splitlines():
        m = COLLECTIVE.search(line)
        if m:
            for dims in re.findall(r"[a-z0-9]+\[([\d,]*)\]", m.group(1)):
                out[m.group(2)].append(tuple(int(d) for d in dims.split(",") if d))
    return out


def compiled_collectives(small_config, sequence_parallel):
    cfg = small_config("mesh.data=2", "mesh.tensor=4", f"parallel.sequence_parallel={sequence_parallel}")
    tr = build_trainer(cfg)
    b_local, seq, hidden = cfg.train.global_batch // 2, cfg.train.seq_len, cfg.model.hidden_size
    return collectives(tr.step_fn.as_text()), (b_local, seq, hidden)


def is_activation(shape, b, s, h):
    return shape in {(b, s, h), (b, s // 4, h)}


def test_sequence_parallel_uses_reduce_scatter_and_all_gather(small_config):
    ops, (b, s, h) = compiled_collectives(small_config, "true")
    assert (b, s // 4, h) in ops["reduce-scatter"], ops["reduce-scatter"]
    assert (b, s, h) in ops["all-gather"], ops["all-gather"]
    assert not [x for x in ops["all-reduce"] if is_activation(x, b, s, h)], ops["all-reduce"]


def test_plain_tensor_parallel_all_reduces_activations(small_config):
    """Control: without SP the same layout all-reduces full activations (so the check above can fail)."""
    ops, (b, s, h) = compiled_collectives(small_config, "false")
    assert [x for x in ops["all-reduce"] if x == (b, s, h)], ops["all-reduce"]
    assert not ops["reduce-scatter"]


@pytest.mark.parametrize("overrides", [
    ["mesh.data=2", "mesh.fsdp=2", "mesh.tensor=2", "parallel.sequence_parallel=true"],
    ["mesh.data=4", "mesh.tensor=2", "parallel.distributed_optimizer=true"],
])
def test_state_shardings_follow_rules(small_config, overrides):
    cfg = small_config(*overrides)
    tr = build_trainer(cfg)
    flat_axes = jax.tree_util.tree_flatten_with_path(tr.spec.axes, is_leaf=lambda x: isinstance(x, tuple))[0]
    params = dict(jax.tree_util.tree_flatten_with_path(tr.state.params)[0])
    mu = dict(jax.tree_util.tree_flatten_with_path(tr.state.opt_state[0].mu)[0])
    checked = 0
    for path, names in flat_axes:
        for arr, table in ((params[path], tr.rules.params), (mu[path], tr.rules.opt_state)):
            want = NamedSharding(tr.mesh, logical_to_spec(names, table))
            assert arr.sharding.is_equivalent_to(want, arr.ndim), (path, arr.sharding, want)
            checked += 1
    assert checked == 2 * len(flat_axes) > 0
    # The tables do what they say: FSDP shards `embed`; ZeRO-1 shards optimizer state over data.
    q = tr.state.params["layers"]["attn"]["q"]["kernel"]
    q_mu = tr.state.opt_state[0].mu["layers"]["attn"]["q"]["kernel"]
    if "parallel.distributed_optimizer=true" in overrides:
        assert "data" not in str(q.sharding.spec) and "data" in str(q_mu.sharding.spec)
    else:
        assert "fsdp" in str(q.sharding.spec)
