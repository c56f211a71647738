"""Tensor-parallel collectives overlapped with the products (parallel.tp_comm_overlap, issue 61 §3).

The collective matmuls of megajax/parallel/tensor.py (on GPUs: the sequence-parallel products as rings
of partial products beside collective-permutes) compute what the one gather or scatter computes, values
and gradients, on the CPU's simulated devices (forced on here: a CPU run keeps the plain form); the
compiled ring has no all-gather or reduce-scatter left; a model trained with them tracks one device.
The XLA flags megajax adds for them (megajax/xla_env.py) are set only where a GPU may run, never over the
caller's own, and a CPU process accepts them (XLA aborts on flags it does not know)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest

from megajax import xla_env
from megajax.models.layers import flat_dot_general
from megajax.parallel import tensor
from test_gradients import PROJECTIONS, _normal, assert_same_value_and_grads, mesh_data_tensor  # noqa: F401

ROOT = Path(__file__).resolve().parent.parent
RULES = {"batch": ("data",), "length": (), "residual_length": ("tensor",), "heads": ("tensor",),
         "vocab": ("tensor",), "embed": ()}


def _ops(mesh, dot, ring):
    return tensor.tensor_parallel_ops(mesh, RULES, dot, sequence_parallel=True, collective_matmul=ring)


@pytest.mark.parametrize("case", [c for c in PROJECTIONS if c != "tied_output_kernel_transposed"])
@pytest.mark.parametrize("dot", ["lax", "flat"])
def test_the_rings_compute_the_gathered_and_scattered_products(mesh_data_tensor, case, dot):  # noqa: F811
    """Column (gather, then the product) and row (the product, then the scatter) over tensor 4, as rings:
    the plain product's values and the gradients of both operands."""
    d = flat_dot_general() if dot == "flat" else jax.lax.dot_general
    ring = _ops(mesh_data_tensor, d, True)
    x_shape, w_shape, dn = PROJECTIONS[case]
    x, w = _normal(5, (4, 16, *x_shape[2:]), w_shape)
    plain = lambda a, b: jax.lax.dot_general(a, b, dn)  # noqa: E731
    assert_same_value_and_grads(lambda a, b: ring.column(a, b, dn), plain, (x, w), (0, 1))
    assert_same_value_and_grads(lambda a, b: ring.row(a, b, dn), plain, (x, w), (0, 1))


def test_the_ring_moves_its_blocks_by_collective_permutes(mesh_data_tensor):  # noqa: F811
    """The compiled column product: n - 1 collective-permutes forward instead of the all-gather; the row
    product: n - 1 of them instead of the reduce-scatter (its backward: the transposed ring)."""
    x, w = _normal(7, (4, 16, 12), (12, 8))
    dn = (((2,), (0,)), ((), ()))
    for ring in (False, True):
        ops = _ops(mesh_data_tensor, jax.lax.dot_general, ring)
        column = jax.jit(lambda a, b: ops.column(a, b, dn)).lower(x, w).compile().as_text()
        row = jax.jit(lambda a, b: ops.row(a, b, dn)).lower(jnp.ones((4, 16, 8)), w.T).compile().as_text()
        if ring:
            assert "all-gather" not in column and column.count("collective-permute-start") + \
                column.count("collective-permute(") >= 3
            assert "reduce-scatter" not in row and "all-reduce" not in row
            assert row.count("collective-permute-start") + row.count("collective-permute(") >= 3
        else:
            assert "all-gather" in column and "collective-permute" not in column


def test_fp8s_products_keep_one_gather(mesh_data_tensor):  # noqa: F811
    """A product the model asks for per layer (FP8's, stateful) keeps the one gather and scatter: its
    scaling reads the whole input."""
    ops = _ops(mesh_data_tensor, jax.lax.dot_general, True)
    x, w = _normal(9, (4, 16, 12), (12, 8))
    dn = (((2,), (0,)), ((), ()))
    text = jax.jit(lambda a, b: ops.layout("column", jax.lax.dot_general)(a, b, dn)).lower(x, w).compile().as_text()
    assert "all-gather" in text and "collective-permute" not in text


@pytest.mark.parametrize("layout", [["mesh.pipeline=2", "mesh.data=2", "mesh.tensor=2", "train.micro_batch=1"],
                                    ["mesh.data=2", "mesh.tensor=4", "train.micro_batch=2"]],
                         ids=["in_the_stage_loop", "data2_tensor4"])
def test_a_model_trained_with_collective_matmuls_tracks_one_device(small_config, monkeypatch, layout):
    """With sequence parallelism and the rings forced on, inside the pipeline's stage loop and outside it:
    loss, grad norm and parameters as one device's."""
    from layout_parity import assert_same_run, reference, run
    from megajax.train import state
    built = []

    def forced(*args, **kw):
        built.append(kw)
        return tensor.tensor_parallel_ops(*args, **{**kw, "collective_matmul": True})

    monkeypatch.setattr(state, "tensor_parallel_ops", forced)
    model = ["model.num_layers=4"]
    ref = reference(small_config, *model, "train.micro_batch=2")
    got = run(small_config, *model, *layout, "parallel.sequence_parallel=true", devices=jax.devices())
    assert built and not built[0]["collective_matmul"]  # (a CPU run asks for the plain products)
    assert_same_run(got, ref)


# ---- the XLA flags ----

def test_the_overlap_flags_where_a_gpu_may_run_with_tensor_parallelism():
    """With tensor parallelism and parallel.tp_comm_overlap on a machine with a GPU plugin (or
    JAX_PLATFORMS naming one): the latency-hiding scheduler, windowed einsums for every size, on their own
    streams; never on a CPU-only run, without tensor parallelism, or with the overlap off."""
    flags = xla_env.prepare(0, {"JAX_PLATFORMS": "cuda"}, tensor_overlap=True).split()
    assert flags == list(xla_env.TP_OVERLAP_FLAGS)
    assert "--xla_gpu_enable_latency_hiding_scheduler=true" in flags
    assert "--xla_gpu_threshold_for_windowed_einsum_mib=0" in flags
    assert "--xla_gpu_multi_streamed_windowed_einsum=true" in flags
    for platforms in ("cpu", "tpu"):
        assert "xla_gpu" not in xla_env.prepare(0, {"JAX_PLATFORMS": platforms}, tensor_overlap=True)
    assert xla_env.prepare(0, {"JAX_PLATFORMS": "cuda"}, tensor_overlap=False) == ""
    assert "xla_gpu" not in xla_env.prepare(8, {"JAX_PLATFORMS": "cpu"}, tensor_overlap=True)


def test_the_callers_overlap_flags_win():
    """A flag the caller's XLA_FLAGS names is left as it is (the others are still added): the GPU suite's
    `off` run names them with XLA's defaults."""
    env = {"JAX_PLATFORMS": "cuda", "XLA_FLAGS": "--xla_gpu_enable_latency_hiding_scheduler=false"}
    flags = xla_env.prepare(0, env, tensor_overlap=True).split()
    assert "--xla_gpu_enable_latency_hiding_scheduler=false" in flags
    assert "--xla_gpu_enable_latency_hiding_scheduler=true" not in flags
    assert "--xla_gpu_threshold_for_windowed_einsum_mib=0" in flags
    assert xla_env.prepare(0, {"JAX_PLATFORMS": "cuda", "XLA_FLAGS": " ".join(xla_env.TP_OVERLAP_OFF)},
                           tensor_overlap=True).split() == list(xla_env.TP_OVERLAP_OFF)


def test_without_jax_platforms_a_gpu_plugin_decides(monkeypatch):
    monkeypatch.setattr(xla_env, "accelerator_plugins", lambda: ["xla_cuda12"])
    assert xla_env.gpu_possible({}) and "windowed_einsum" in xla_env.prepare(0, {}, tensor_overlap=True)
    monkeypatch.setattr(xla_env, "accelerator_plugins", lambda: ["libtpu"])
    assert not xla_env.gpu_possible({}) and "xla_gpu" not in xla_env.prepare(0, {}, tensor_overlap=True)
    monkeypatch.setattr(xla_env, "accelerator_plugins", lambda: [])
    assert not xla_env.gpu_possible({})


CHILD = r"""
import json, os
import jax, jax.numpy as jnp
print(json.dumps({"sum": float(jnp.arange(4.0).sum()), "flags": os.environ.get("XLA_FLAGS", "")}))
"""


@pytest.mark.parametrize("flags", ["TP_OVERLAP_FLAGS", "TP_OVERLAP_OFF"])
def test_xla_accepts_the_overlap_flags(flags):
    """The installed jaxlib parses every flag (XLA aborts a process on one it does not know: `megajax
    train` would stop before its first step); GPU flags are parsed on a CPU-only run too."""
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env.update(JAX_PLATFORMS="cpu", XLA_FLAGS=" ".join(getattr(xla_env, flags)))
    out = subprocess.run([sys.executable, "-c", CHILD], env=env, capture_output=True, text=True, timeout=300,
                         cwd=ROOT, check=False)
    assert out.returncode == 0, out.stderr[-2000:]
    assert json.loads(out.stdout.strip().splitlines()[-1])["sum"] == 6.0
    assert "Unknown flag" not in out.stderr
    bad = dict(env, XLA_FLAGS="--xla_gpu_enable_async_collectives=true")  # removed from XLA: the check can fail
    assert subprocess.run([sys.executable, "-c", CHILD], env=bad, capture_output=True, text=True, timeout=300,
                          cwd=ROOT, check=False).returncode != 0


def test_the_gpu_suites_section_times_tensor_2_with_and_without(tmp_path):
    """scripts/gpu_suite.sh's tp_overlap section under CPU_SMOKE=1: two `megajax bench` runs of tensor 2 on 2
    simulated devices, with the overlap and without (XLA's defaults named in XLA_FLAGS), their step times
    and ratio under $OUT (on a CPU both run the plain products: the code path, not a measurement)."""
    out = tmp_path / "results"
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}
    env.update(CPU_SMOKE="1", SECTIONS="tp_overlap", OUT=str(out), PYTHON=sys.executable, SUITE_BUDGET_S="600")
    p = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_suite.sh")], env=env, cwd=tmp_path, capture_output=True,
                       text=True, timeout=900)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-2000:]
    r = json.loads((out / "tp_overlap.json").read_text())
    assert r["ok"] and r["speedup"] == pytest.approx(r["off"]["step_seconds"] / r["on"]["step_seconds"])
    for mode in ("on", "off"):
        assert r[mode]["step_seconds"] > 0 and r[mode]["layout"]["mesh"]["tensor"] == 2
        assert r[mode]["layout"]["sequence_parallel"] and "xla_gpu" not in r[mode]["xla_flags"].replace(
            " ".join(xla_env.TP_OVERLAP_OFF), "")
    assert " ".join(xla_env.TP_OVERLAP_OFF) in r["off"]["xla_flags"]
    summary = json.loads((out / "summary.json").read_text())
    assert [s["status"] for s in summary["sections"]] == ["ok"]
