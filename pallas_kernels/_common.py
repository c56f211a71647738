"""Helpers the Pallas GEMM kernels share: the platform a kernel compiles for, tile arithmetic,
masked tile loads and the grouped program order.

    cdiv(a, b), next_pow2(n)                  tile counts and power-of-two tile sizes
    on_rocm(), shared_memory_per_block()      what the default device is (None / False off-GPU)
    default_interpret(interpret)              None -> interpret mode exactly on CPU
    valid(start, size, limit, column=)        [size, 1] / [1, size] masks of in-range indices
    masked_load(ref, rows, cols, mask)        ref[rows, cols] with masked-off entries read as 0
    tile_ids(pid, num_m, num_n, group_m)      (tile row, tile column) of program `pid`
    varying(x), max_over(x, axes), sum_to(ct, primal)   shard_map's varying axes in custom VJPs
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental.pallas import triton as plgpu


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def next_pow2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def on_rocm() -> bool:
    """Whether the default device is an AMD GPU (ROCm)."""
    try:
        return "rocm" in jax.devices()[0].client.platform_version.lower()
    except Exception:  # no device, or a client without the attribute: not ROCm
        return False


def compute_capability() -> tuple[int, int] | None:
    """(major, minor) of the default NVIDIA GPU, or None (CPU, ROCm, unknown)."""
    try:
        major, minor = (int(v) for v in str(jax.devices()[0].compute_capability).split("."))
    except Exception:  # CPU, ROCm, or a device without the attribute
        return None
    return major, minor


def shared_memory_per_block() -> int | None:
    """Shared memory a Triton kernel may use on the default NVIDIA GPU (bytes), from its
    compute capability: 227 KiB on sm_90+, 99 KiB on sm_89/sm_86, 163 KiB on sm_80;
    None when unknown (no GPU: lowering assumes sm_90)."""
    cc = compute_capability()
    if cc is None:
        return None
    if cc[0] >= 9:
        return 227 * 1024
    return 163 * 1024 if cc == (8, 0) else 99 * 1024


SHARED_MEMORY_USE = 0.9  # of the per-block shared memory, for a GEMM kernel's operand pipeline


def stages_that_fit(num_stages: int, stage_bytes: int, shared_memory: int | None) -> int:
    """A GEMM's software-pipeline depth `num_stages`, lowered to what SHARED_MEMORY_USE of the block's
    `shared_memory` holds at `stage_bytes` a stage (at least 1; unchanged when the size is unknown)."""
    if shared_memory is None:
        return num_stages
    return max(1, min(num_stages, int(SHARED_MEMORY_USE * shared_memory) // stage_bytes))


def default_interpret(interpret: bool | None) -> bool:
    """Pallas interpret mode: as given, else exactly when the default backend is CPU."""
    return jax.default_backend() == "cpu" if interpret is None else bool(interpret)


def valid(start, size: int, limit: int, *, column: bool):
    """[size, 1] (or [1, size] if column) mask of indices start + i < limit."""
    shape = (1, size) if column else (size, 1)
    return start + lax.broadcasted_iota(jnp.int32, shape, 1 if column else 0) < limit


def both(x, y):
    """x & y of two masks, either of which may be None (no mask)."""
    if x is None:
        return y
    return x if y is None else x & y


def masked_load(ref, rows, cols, mask):
    """ref[rows, cols] (pl.ds slices); masked-off entries read as 0."""
    view = ref.at[rows, cols]
    if mask is None:
        return view[...]
    return plgpu.load(view, mask=mask, other=jnp.zeros((), ref.dtype))


def tile_ids(pid, num_m: int, num_n: int, group_m: int):
    """(tile row, tile column) of program `pid`: groups of group_m tile rows, column-major
    inside a group, so that consecutive programs reuse b tiles and nearby a tiles in L2."""
    width = group_m * num_n
    first = lax.div(pid, jnp.int32(width)) * group_m
    rows = jnp.minimum(num_m - first, group_m)
    in_group = lax.rem(pid, jnp.int32(width))
    return first + lax.rem(in_group, rows), lax.div(in_group, rows)


def varying(x) -> frozenset:
    """The shard_map axes a traced value is typed as varying over (empty outside one)."""
    t = jax.typeof(x)
    mat = getattr(t, "manual_axis_type", None)
    return frozenset(getattr(mat, "varying", ())) if mat is not None else frozenset(getattr(t, "vma", ()))


def max_over(amax, axes):
    axes = tuple(sorted(axes))
    return jax.lax.pmax(amax, axes) if axes else amax


def sum_to(ct, primal):
    """Inside a shard_map: a cotangent summed over the axes it varies over and its primal does not
    (a weight replicated over `tensor` meeting split activations), as JAX's own rules do."""
    extra = tuple(sorted(varying(ct) - varying(primal)))
    return jax.lax.psum(ct, extra) if extra else ct
