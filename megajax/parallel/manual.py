"""shard_map for the explicit collectives, also inside a pipeline stage.

A pipeline stage is itself a `shard_map` over `pipeline` whose backward is
written by hand (megajax/parallel/pipeline.py: `jax.vjp` of a chunk inside the
stage loop). Differentiating a `shard_map` nested in another one fails in JAX
(0.10 and 0.11) under jvp/transpose, so the explicit collectives of sequence
parallelism, context parallelism, the sharded attention kernels and the MoE
dispatch cannot be differentiated there as they are elsewhere. `shard_map_fn`
gives them a `custom_vjp` whose forward and backward are each a plain
`shard_map` over the current (abstract) mesh: the backward recomputes the
local function and takes its VJP inside the per-device body, where the body's
own collectives transpose as usual (e.g. an all-gather into a reduce-scatter,
and a replicated weight's gradient is summed over the axes its use varied on).
The price is one more run of the local forward in the backward.

Whether a call runs inside a stage is read from its trace context (`inside_manual`), never passed.
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from megajax.mesh import _drop, mesh_sizes, spec_axes


def _differentiable(x) -> bool:
    return x is not None and jnp.issubdtype(jnp.result_type(x), jnp.inexact)


def varying_axes(x) -> frozenset:
    """The manual mesh axes a traced value is typed as varying over (empty outside shard_map)."""
    t = jax.typeof(x)
    mat = getattr(t, "manual_axis_type", None)
    if mat is not None:
        return frozenset(getattr(mat, "varying", ()))
    return frozenset(getattr(t, "vma", ()))


def like(g, *primals):
    """`g` typed as varying over the manual mesh axes any of `primals` varies over (a shard_map
    without check_vma returns values typed as invariant; inside one, slices and products of a
    varying value may be typed either way)."""
    want = set().union(*(varying_axes(p) for p in primals))
    missing = tuple(sorted(want - varying_axes(g)))
    return jax.lax.pcast(g, missing, to="varying") if missing else g


def _varying_over(x, spec):
    """`x` typed as varying over the mesh axes of `spec` (the manual axes of the current shard_map)."""
    used = set(spec_axes(spec))
    missing = tuple(sorted(used - varying_axes(x)))
    return jax.lax.pcast(x, missing, to="varying") if missing else x


def inside_manual() -> bool:
    """Whether the code being traced runs inside a shard_map (a pipeline stage's loop)."""
    return bool(jax.sharding.get_abstract_mesh().manual_axes)


def shard_map_fn(local: Callable, mesh, in_specs: tuple, out_specs, *, check_vma: bool = True) -> Callable:
    """jax.shard_map(local, ...) as a function of its positional arguments. Traced inside another
    shard_map (`inside_manual`), it runs on the mesh in context and is differentiated as described
    in the module docstring (arguments that are None or not floating point get no cotangent)."""
    plain = jax.shard_map(local, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=check_vma)

    def call(*args):
        if not inside_manual():
            return plain(*args)
        here = jax.sharding.get_abstract_mesh()

        # The enclosing shard_map's axes (already split there) and axes of size 1 (nothing to split:
        # left in a spec beside the outer axes they trip a check of the partitioner) are dropped.
        outer = set(here.manual_axes) | {a for a, n in mesh_sizes(here).items() if n == 1}

        def strip(spec):
            """A spec (or a tuple of specs: a function's several outputs) without the outer axes."""
            if spec is None:
                return None
            if isinstance(spec, P):
                return P(*(_drop(e, outer) for e in spec))
            return tuple(strip(x) for x in spec)

        def sm(f, i, o):
            return jax.shard_map(f, mesh=here, in_specs=tuple(strip(x) for x in i), out_specs=strip(o),
                                 check_vma=check_vma)

        if all(a in outer for a in here.axis_names):  # nothing left to split: run it in place
            return local(*args)
        diff = tuple(_differentiable(a) for a in args)

        @jax.custom_vjp
        def f(*args):
            return sm(local, in_specs, out_specs)(*args)

        def fwd(*args):
            return f(*args), args

        def bwd(saved, g):
            def local_bwd(g, *a):
                def of_diff(*d):
                    it = iter(d)
                    out = local(*(next(it) if k else x for k, x in zip(diff, a)))
                    # Typed as varying where the out specs split them (as the cotangents are).
                    return jax.tree.map(lambda o, sp: _varying_over(o, sp), out, strip(out_specs),
                                        is_leaf=lambda x: isinstance(x, P))
                _, vjp = jax.vjp(of_diff, *(x for k, x in zip(diff, a) if k))
                return vjp(g)

            d_specs = tuple(s for k, s in zip(diff, in_specs) if k)
            grads = iter(sm(local_bwd, (out_specs, *in_specs), d_specs)(g, *saved))
            return tuple(like(next(grads), x) if k else None for k, x in zip(diff, saved))

        f.defvjp(fwd, bwd)
        return f(*args)

    return call
