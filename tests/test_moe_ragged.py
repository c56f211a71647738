"""parallel.moe_all_to_all=ragged: the dropless dispatch with jax.lax.ragged_all_to_all, which moves
only the real rows. XLA:CPU has no ragged-all-to-all, so here the exchange is
`emulated_ragged_all_to_all` (checked against the op's documented semantics in numpy), and the
dispatch's bookkeeping (offsets, receive layout, the way back) must train exactly as one device."""

import jax
import numpy as np
import pytest
from jax.sharding import AxisType, PartitionSpec as P

from layout_parity import MOE, assert_same_run, reference, run
from megajax.config import load_config
from megajax.errors import ConfigError
from megajax.parallel import experts


def _documented(operand, output, input_offsets, send_sizes, output_offsets, recv_sizes):
    """numpy, over all devices at once ([devices, ...] arrays, one slice per device): the op's
    docstring pseudo-code (SEND slice i of device s to device i; device r writes the slice from s
    at device s's output_offsets[r])."""
    out = output.copy()
    n = operand.shape[0]
    for s in range(n):
        for r in range(n):
            size = send_sizes[s, r]
            assert size == recv_sizes[r, s]
            data = operand[s, input_offsets[s, r]:input_offsets[s, r] + size]
            out[r, output_offsets[s, r]:output_offsets[s, r] + size] = data
    return out


def test_the_emulation_follows_the_documented_semantics():
    n, rows, out_rows = 4, 6, 20
    rng = np.random.default_rng(0)
    send = rng.integers(0, 3, (n, n)).astype(np.int32)  # [source, dest], sum per source <= rows
    input_offsets = (np.cumsum(send, axis=1) - send).astype(np.int32)
    recv = send.T.copy()
    # Receivers place sources in reverse order with a gap, so offsets are not the trivial ones.
    recv_offsets = np.zeros((n, n), np.int32)
    for r in range(n):
        at = 1
        for s in reversed(range(n)):
            recv_offsets[r, s] = at
            at += recv[r, s] + 1
    output_offsets = recv_offsets.T.copy()  # [source, dest]: where source's slice lands on dest
    operand = rng.normal(size=(n, rows, 3)).astype(np.float32)
    output = np.full((n, out_rows, 3), -1.0, np.float32)
    mesh = jax.make_mesh((n,), ("x",), axis_types=(AxisType.Auto,), devices=jax.devices()[:n])
    f = jax.jit(jax.shard_map(
        lambda *a: experts.emulated_ragged_all_to_all(*(x[0] for x in a), axis_name="x")[None],
        mesh=mesh, in_specs=(P("x"),) * 6, out_specs=P("x")))
    got = f(operand, output, input_offsets, send, output_offsets, recv)
    np.testing.assert_array_equal(np.asarray(got), _documented(operand, output, input_offsets, send,
                                                               output_offsets, recv))


@pytest.fixture
def emulated(monkeypatch):
    monkeypatch.setattr(experts, "RAGGED_ALL_TO_ALL", experts.emulated_ragged_all_to_all)


def test_ragged_dispatch_matches_one_device(small_config, emulated):
    """Expert 4 x data 2 (the reference is the expert-parallel layout tests' one-device run)."""
    ref = reference(small_config, *MOE)
    got = run(small_config, *MOE, "mesh.data=2", "mesh.expert=4", "parallel.moe_all_to_all=ragged",
              devices=jax.devices())
    assert_same_run(got, ref)


def test_ragged_errors_name_the_key():
    from megajax.plan import make_plan
    from megajax.train.setup import build_setup
    with pytest.raises(ConfigError, match=r"parallel.moe_all_to_all = ragged with model.moe_expert_capacity_factor "
                                          r"= 1.0.*parallel.moe_all_to_all=padded"):
        load_config(overrides=MOE + ["parallel.moe_all_to_all=ragged", "model.moe_expert_capacity_factor=1.0"])
    cfg = load_config(overrides=MOE + ["parallel.moe_all_to_all=ragged", "mesh.data=4", "mesh.expert=2",
                                       "model.num_layers=2", "model.hidden_size=64", "model.num_heads=4",
                                       "train.seq_len=32", "train.global_batch=8", "model.vocab_size=300"])
    with pytest.raises(ConfigError, match=r"XLA:CPU does not implement.*parallel.moe_all_to_all=padded on CPU"):
        build_setup(make_plan(cfg, 8), jax.devices())
