"""Packed sequences (several documents per row, `segment_ids` and `positions` restarting in each):
a packed batch computes what its documents compute one at a time.

Two steps make the property, each with few compiles:
- one device: the loss sum (and multi-token prediction's) and every parameter's gradient of a packed
  batch equal those of its documents each alone in a row (fp32, 1e-5 relative), for a dense Llama, a
  hybrid (Mamba-2 + attention + MoE) and multi-latent attention with MTP (tiny-deepseek-v3); the same
  packed batch with one segment id per row (documents mixed) differs, so the documents matter;
- layouts: the train step on a packed batch gives one device's loss, grad norm and updated
  parameters on tensor x sequence, pipeline (GPipe, 1F1B, interleaved), context (ring, all-gather),
  FSDP and expert parallel layouts, and for the hybrid on context and tensor parallel layouts.
"""

from __future__ import annotations

import contextlib
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from megajax.config import load_config
from megajax.mesh import load_balanced_order
from megajax.plan import make_plan
from megajax.train.loss import cross_entropy, mtp_loss_sum
from megajax.train.setup import build_setup
from megajax.train.state import build_model_spec

from conftest import SMALL
from layout_parity import PARITY

VOCAB = 257
KEYS = ("tokens", "labels", "loss_mask", "positions", "segment_ids")
PACKED_DATA = ["data.reset_position_ids=true", "data.reset_attention_mask=true"]  # the batch carries both keys


def documents(rng: np.random.Generator, lengths) -> list[np.ndarray]:
    """Random documents of `lengths` + 1 tokens (inputs are all but the last, labels all but the first)."""
    return [rng.integers(1, VOCAB, n + 1) for n in lengths]


def pack(docs: list[np.ndarray], rows: int, seq: int) -> dict:
    """Documents packed greedily in order into `rows` rows of `seq` tokens: segment ids count the
    documents of a row from 0, positions restart at 0 in each; the row's tail is padding with a
    segment id of its own and loss mask 0."""
    out = {k: np.zeros((rows, seq), np.float32 if k == "loss_mask" else np.int32) for k in KEYS}
    row, at, seg = 0, 0, 0
    for d in docs:
        n = len(d) - 1
        if at + n > seq:
            out["segment_ids"][row, at:] = seg
            row, at, seg = row + 1, 0, 0
        assert row < rows, "the documents do not fit"
        span = slice(at, at + n)
        out["tokens"][row, span], out["labels"][row, span] = d[:-1], d[1:]
        out["loss_mask"][row, span], out["positions"][row, span] = 1.0, np.arange(n)
        out["segment_ids"][row, span] = seg
        at, seg = at + n, seg + 1
    out["segment_ids"][row, at:] = seg
    for r in range(row + 1, rows):
        out["segment_ids"][r] = 0
    return out


def alone(docs: list[np.ndarray], seq: int) -> dict:
    """Each document at the start of its own row, padding after it (no segment ids: one document)."""
    out = {k: np.zeros((len(docs), seq), np.float32 if k == "loss_mask" else np.int32) for k in KEYS[:4]}
    for r, d in enumerate(docs):
        n = len(d) - 1
        out["tokens"][r, :n], out["labels"][r, :n], out["loss_mask"][r, :n] = d[:-1], d[1:], 1.0
        out["positions"][r] = np.arange(seq)
    return out


def test_pack_lays_out_documents_as_a_packer_does():
    docs = documents(np.random.default_rng(0), [5, 3, 7, 3])
    p = pack(docs, 2, 10)
    np.testing.assert_array_equal(p["segment_ids"], [[0] * 5 + [1] * 3 + [2] * 2, [0] * 7 + [1] * 3])
    np.testing.assert_array_equal(p["positions"][1], [0, 1, 2, 3, 4, 5, 6, 0, 1, 2])
    np.testing.assert_array_equal(p["tokens"][0, 5:8], docs[1][:-1])
    np.testing.assert_array_equal(p["labels"][1, 7:], docs[3][1:])
    np.testing.assert_array_equal(p["loss_mask"][0], [1] * 8 + [0] * 2)
    with pytest.raises(AssertionError):
        pack(documents(np.random.default_rng(0), [5, 6, 7]), 2, 10)


# --------------------------------------------------------------------------- one device: packed == alone

SEQ = 64
LLAMA = [*SMALL[:5], "model.num_layers=2"]
# 'M*-E' twice: Mamba-2 (16 heads of 8, 2 groups, state 8, chunks of 8: documents start mid-chunk and
# span chunks), attention without positions, an MLP, a mixture of 4 experts (dropless: per token).
HYBRID = ["model.hybrid_layer_pattern=M*-EM*-E", "model.activation=squared_relu", "model.position_embedding=none",
          "model.hidden_size=64", "model.num_heads=8", "model.num_kv_heads=4", "model.ffn_hidden_size=128",
          "model.mamba_state_dim=8", "model.mamba_head_dim=8", "model.mamba_num_groups=2",
          "model.mamba_chunk_size=8", "model.num_experts=4", "model.moe_router_topk=2", "model.moe_ffn_hidden_size=32"]
MODELS = {
    "llama": ([], LLAMA),
    "llama_flash_attention": ([], LLAMA + ["model.attention_impl=flash"]),
    "hybrid": ([], HYBRID),
    "hybrid_pallas_ssd": ([], HYBRID + ["model.mamba_chunk_size=16", "model.mamba_ssd_impl=pallas"]),
    "deepseek_v3_mla_mtp": (["model/tiny-deepseek-v3"], []),
}
LENGTHS = [9, 17, 5, 30, 11, 20, 3, 14, 25, 12]  # 146 tokens: 3 packed rows of 64


def sums_and_grads(cfg, params, spec, batch):
    """(loss sum, MTP loss sum or 0, gradients of their sum) of the model's cross entropy on `batch`."""
    depths = cfg.model.mtp_num_layers

    def objective(params):
        out = spec.apply(params, batch["tokens"], batch["positions"], batch.get("segment_ids"),
                         router_stats=True, **({"mtp": True} if depths else {}))
        loss = jnp.sum(cross_entropy(out[0], batch["labels"]) * batch["loss_mask"])
        mtp = mtp_loss_sum(out[2], batch["labels"], batch["loss_mask"], spec.sequence_shift,
                           batch.get("segment_ids")) if depths else jnp.float32(0)
        return loss + mtp, (loss, mtp)

    (_, sums), grads = jax.value_and_grad(objective, has_aux=True)(params)
    return sums, grads


@pytest.mark.parametrize("model", list(MODELS))
def test_a_packed_batch_computes_its_documents_one_at_a_time(model):
    files, overrides = MODELS[model]
    cfg = load_config(files, [f"model.vocab_size={VOCAB}", f"train.seq_len={SEQ}", *overrides])
    spec, init = build_model_spec(cfg, cfg.model.padded_vocab_size())
    params = jax.jit(init)()
    docs = documents(np.random.default_rng(1), LENGTHS)
    packed, single = pack(docs, 3, SEQ), alone(docs, SEQ)
    run = jax.jit(functools.partial(sums_and_grads, cfg, spec=spec))
    (loss, mtp), grads = run(params, batch=packed)
    (want_loss, want_mtp), want = run(params, batch=single)
    np.testing.assert_allclose(loss, want_loss, rtol=1e-5)
    np.testing.assert_allclose(mtp, want_mtp, rtol=1e-5)
    assert (float(mtp) > 0) == bool(cfg.model.mtp_num_layers)
    assert _grad_error(grads, want) <= 1e-5
    # Control: the same rows as one document each (the same program) differ, so the boundaries matter
    # (at initialisation the loss barely moves; the gradients do).
    _, mixed = run(params, batch={**packed, "segment_ids": np.zeros_like(packed["segment_ids"])})
    assert _grad_error(mixed, want) > 1e-2


def _grad_error(grads, want) -> float:
    """The largest difference of any parameter's gradient, relative to that gradient's largest element."""
    errors = []
    for g, w in zip(jax.tree.leaves(grads), jax.tree.leaves(want), strict=True):
        g, w = np.asarray(g), np.asarray(w)
        errors.append(float(np.max(np.abs(g - w))) / max(float(np.max(np.abs(w))), 1e-30))
    return max(errors)


# --------------------------------------------------------------------------- layouts: packed == one device

LAYOUT_SEQ, ROWS = 32, 8


def packed_rows(seed: int) -> dict:
    """ROWS rows of LAYOUT_SEQ tokens, each packed with documents of 1..15 tokens (some rows ending in
    padding): numpy arrays [ROWS, LAYOUT_SEQ]."""
    rng = np.random.default_rng(seed)
    out = {k: [] for k in KEYS}
    for _ in range(ROWS):
        lengths, left = [], LAYOUT_SEQ
        while left > 0 and not (lengths and rng.random() < 0.15):
            lengths.append(int(min(rng.integers(1, 16), left)))
            left -= lengths[-1]
        row = pack(documents(rng, lengths), 1, LAYOUT_SEQ)
        for k in KEYS:
            out[k].append(row[k][0])
    return {k: np.stack(v) for k, v in out.items()}


def one_step(cfg_files, overrides, devices) -> tuple[dict, dict]:
    """(metrics, parameters by path) after one train step on a packed batch, on `devices` laid out
    by `overrides` (the batch split into the plan's microbatches, in context parallelism's order)."""
    from layout_parity import not_persistently_cached
    cfg = load_config(cfg_files, [*SMALL, *PARITY, *PACKED_DATA, "train.steps=4", f"train.seq_len={LAYOUT_SEQ}",
                                  f"train.global_batch={ROWS}", f"model.vocab_size={VOCAB}", *overrides])
    setup = build_setup(make_plan(cfg, len(devices)), devices)
    rows = packed_rows(0)
    accum, _, seq = setup.batch.shape
    context = setup.plan.sizes["context"]
    order = load_balanced_order(seq, context) if context > 1 else np.arange(seq)
    batch = {k: jax.device_put(rows[k][:, order].reshape(accum, -1, seq), setup.batch_shardings[k])
             for k in setup.batch_shardings}
    assert set(batch) == set(KEYS)
    with not_persistently_cached() if context > 1 else contextlib.nullcontext():
        state, metrics, ok = setup.train_step()(setup.fresh_state(), batch, setup.ok_flag())
    assert bool(ok)
    params = {jax.tree_util.keystr(p): np.asarray(x) for p, x in jax.tree_util.tree_leaves_with_path(state.params)}
    return jax.tree.map(np.asarray, metrics), params


@functools.lru_cache(maxsize=None)
def one_device(kind: str):
    files, model = LAYOUT_MODELS[kind]
    return one_step(files, [*model, "mesh.data=1"], jax.devices()[:1])


DENSE = ["model.num_layers=4"]
LAYOUT_MODELS = {
    "llama": ([], DENSE),
    "tiny-moe": (["model/tiny-moe"], ["model.num_layers=2"]),
    "hybrid": ([], ["model.num_layers=null", *HYBRID]),
}
# layout -> (model, overrides). Every pipeline schedule, context parallelism (ring and all-gather)
# inside and outside the stages, tensor x sequence, FSDP, experts; the MoE and hybrid layouts keep one
# microbatch per step as their reference does (the balancing loss is per microbatch).
LAYOUTS = {
    "tensor2_sp_fsdp2_data2": ("llama", ["mesh.tensor=2", "parallel.sequence_parallel=true", "mesh.fsdp=2",
                                         "mesh.data=2"]),
    "pipeline2_gpipe_tensor2_data2": ("llama", ["mesh.pipeline=2", "parallel.pipeline_schedule=gpipe", "mesh.tensor=2",
                                                "mesh.data=2", "train.micro_batch=1"]),
    "pipeline2_1f1b_context2_ring_data2": ("llama", ["mesh.pipeline=2", "parallel.pipeline_schedule=1f1b",
                                                     "mesh.context=2", "mesh.data=2", "train.micro_batch=1"]),
    "pipeline2_interleaved_v2_context2_allgather_data2": (
        "llama", ["mesh.pipeline=2", "parallel.pipeline_schedule=interleaved", "parallel.virtual_stages=2",
                  "mesh.context=2", "parallel.context_impl=allgather", "mesh.data=2", "train.micro_batch=1"]),
    "context4_ring_data2": ("llama", ["mesh.context=4", "mesh.data=2"]),
    "context2_allgather_tensor2_sp_data2": ("llama", ["mesh.context=2", "parallel.context_impl=allgather",
                                                      "mesh.tensor=2", "parallel.sequence_parallel=true",
                                                      "mesh.data=2"]),
    "tiny_moe_expert2_fsdp2_data2": ("tiny-moe", ["mesh.expert=2", "mesh.fsdp=2", "mesh.data=2"]),
    "hybrid_context2_tensor2_sp_data2": ("hybrid", ["mesh.context=2", "mesh.tensor=2",
                                                    "parallel.sequence_parallel=true", "mesh.data=2"]),
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_a_packed_batch_on_a_layout_matches_one_device(layout):
    kind, overrides = LAYOUTS[layout]
    files, model = LAYOUT_MODELS[kind]
    got, got_params = one_step(files, [*model, *overrides], jax.devices())
    want, want_params = one_device(kind)
    for key in ("loss", "grad_norm", "num_tokens"):
        np.testing.assert_allclose(got[key], want[key], rtol=1e-5, err_msg=key)
    assert sorted(got_params) == sorted(want_params)
    for name, w in want_params.items():
        np.testing.assert_allclose(got_params[name], w, rtol=1e-5, atol=1e-7, err_msg=f"{name} after the step")


# --------------------------------------------------------------------------- cuDNN


def test_cudnn_attention_takes_segment_ids_as_its_bias_form(monkeypatch):
    """cuDNN's fused attention honours segment ids through its mask form: the mask (same document)
    becomes an additive bias [B, 1, L, L], so the lowered program (for CUDA, from CPU) calls cuDNN's
    bias kernels forward and backward, in the attention core and in context parallelism's per-block
    kernel; without segment ids the program is cuDNN's plain causal kernel, as before. Its numbers
    against plain jnp are the GPU suite's check (scripts/gpu_check_composed.py)."""
    import re

    from jax._src.cudnn import fused_attention_stablehlo as cudnn

    from megajax.models.attention import cudnn_attention_block, cudnn_attention_core

    monkeypatch.setattr(cudnn, "check_cudnn_version", lambda: 90800)
    sd = jax.ShapeDtypeStruct
    q, kv, seg = sd((2, 128, 8, 64), jnp.bfloat16), sd((2, 128, 2, 64), jnp.bfloat16), sd((2, 128), jnp.int32)

    def kernels(f, *args):
        grad = jax.jit(jax.grad(lambda *a: f(*a).astype(jnp.float32).sum(), argnums=(0, 1, 2)))
        text = grad.trace(*args).lower(lowering_platforms=("cuda",)).as_text()
        return sorted(set(re.findall(r"__cudnn\$fmha\w*", text)))

    core = lambda q, k, v, s=None: cudnn_attention_core(q, k, v, segment_ids=s, causal=True)
    block = lambda q, k, v, s: cudnn_attention_block(q, k, v, q_segment_ids=s, kv_segment_ids=s, causal=False)[0]
    with_bias = ["__cudnn$fmhaScaleBiasSoftmax", "__cudnn$fmhaScaleBiasSoftmaxBackward"]
    assert kernels(core, q, kv, kv, seg) == with_bias
    assert kernels(block, q, kv, kv, seg) == with_bias
    assert kernels(core, q, kv, kv) == ["__cudnn$fmhaSoftmax", "__cudnn$fmhaSoftmaxBackward"]
