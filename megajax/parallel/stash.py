"""What a pipeline stage keeps of a forward for its backward: the VJP residuals of a chunk, split in two.

`jax.vjp` returns its backward as a pytree whose leaves are the residuals (the activations the
backward reads) and whose structure holds the linearised program; the leaves may be carried out of
the trace they were made in and put back together later (JAX's vjp functions are pytrees so that
they can cross jit boundaries). A pipeline stage runs a microbatch's forward in one tick and its
backward ticks later, so it keeps those leaves in its stash in between.

Some residuals are not activations: the weights themselves (a layer's `h @ w`), or what the
forward made of them alone (a bf16 copy of fp32 weights, the fused q/k/v kernel concatenated from
three, an FP8 weight copy). Kept per in-flight microbatch they would cost a copy of the chunk's
weights per stash slot. Partial evaluation of the forward with the weights known and the
per-microbatch inputs unknown tells the two apart: a residual the weights alone determine is
computed again from them in the backward (casts and concatenations, no product with an
activation), the others are stashed.

    split = split_vjp(fn, known, unknown)        # once, on example values: fn -> (outs, vjp, aux)
    outs, aux, kept = split.forward(known, unknown)
    ... ticks later ...
    vjp = split.backward(known, kept)            # the same known values
    cotangents = vjp(outs_cotangent)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import jax
from jax.extend.core import jaxpr_as_fun
# Partial evaluation and dead-code elimination of a jaxpr: what `jax.linearize` and `jax.checkpoint`
# are built on, with no public entry point.
from jax._src.interpreters import partial_eval as pe


@dataclass(frozen=True)
class SplitVJP:
    """A function's forward with its VJP residuals split into kept (stashed) and recomputed ones."""
    forward_jaxpr: Any  # ClosedJaxpr: (known, unknown) leaves -> (outs, aux) leaves + residual leaves
    vjp_tree: Any  # the VJP's treedef (its linearised program)
    out_tree: Any  # treedef of (outs, aux)
    kept: tuple[int, ...]  # residual leaves kept in the stash
    again: tuple[int, ...]  # residual leaves computed again from the known inputs
    again_jaxpr: Any  # Jaxpr: (its consts, the known leaves it uses) -> the `again` leaves
    again_consts: tuple
    again_inputs: tuple[bool, ...]  # which known leaves again_jaxpr takes
    kept_avals: tuple  # shapes, dtypes (and manual axes they vary over) of the kept leaves

    def forward(self, known, unknown) -> tuple[Any, Any, list]:
        """(outs, aux, kept residual leaves) of the function on these inputs."""
        flat = jaxpr_as_fun(self.forward_jaxpr)(*jax.tree.leaves((known, unknown)))
        n = self.out_tree.num_leaves
        outs, aux = jax.tree.unflatten(self.out_tree, flat[:n])
        return outs, aux, [flat[n + k] for k in self.kept]

    def backward(self, known, kept: list) -> Callable:
        """The VJP of the forward that kept `kept`, given the same `known` inputs."""
        inputs = [x for x, used in zip(jax.tree.leaves(known), self.again_inputs) if used]
        again = jax.core.eval_jaxpr(self.again_jaxpr, (), *self.again_consts, *inputs)
        leaves = [None] * (len(self.kept) + len(self.again))
        for k, x in zip(self.kept, kept):
            leaves[k] = x
        for k, x in zip(self.again, again):
            leaves[k] = x
        return jax.tree.unflatten(self.vjp_tree, leaves)

    def kept_bytes(self) -> int:
        """Bytes of one call's kept residuals (one stash slot)."""
        return sum(a.size * a.dtype.itemsize for a in self.kept_avals)


def split_vjp(fn: Callable, known, unknown) -> SplitVJP:
    """Traces `fn(known, unknown) -> (outs, vjp, aux)` (`vjp` what jax.vjp returned: differentiate
    inside `fn` with respect to whichever inputs it likes) on example inputs, and splits the VJP's
    residuals by whether they depend on `unknown` (kept) or on `known` alone (computed again)."""
    trees = {}

    def flat_forward(known, unknown):
        outs, vjp, aux = fn(known, unknown)
        leaves, trees["vjp"] = jax.tree.flatten(vjp)
        flat, trees["out"] = jax.tree.flatten((outs, aux))
        return flat + leaves

    closed = jax.make_jaxpr(flat_forward)(known, unknown)
    n_known, n_unknown = len(jax.tree.leaves(known)), len(jax.tree.leaves(unknown))
    n_out = trees["out"].num_leaves
    # The known half computes from the known inputs alone every output that does not depend on the
    # unknown ones (first, in order), then what the unknown half needs of it.
    known_half, _, out_unknown, _ = pe.partial_eval_jaxpr_nounits(
        closed, [False] * n_known + [True] * n_unknown, instantiate=False)
    residual_unknown = out_unknown[n_out:]
    kept = tuple(k for k, u in enumerate(residual_unknown) if u)
    again = tuple(k for k, u in enumerate(residual_unknown) if not u)
    # The `again` leaves: the known half with its other outputs dropped and dead code eliminated.
    known_outs = [n >= n_out for n, u in enumerate(out_unknown) if not u]
    jaxpr = pe.convert_constvars_jaxpr(known_half.jaxpr)
    used_outputs = known_outs + [False] * (len(jaxpr.outvars) - len(known_outs))
    dce, _ = pe.dce_jaxpr(jaxpr, used_outputs, instantiate=True)
    # The inputs the remaining equations read (dce_jaxpr keeps a loop's dropped carry as an input).
    read = {id(v) for e in dce.eqns for v in e.invars} | {id(v) for v in dce.outvars}
    used = [id(v) in read for v in dce.invars]
    n_consts = len(known_half.consts)
    consts = tuple(c for c, u in zip(known_half.consts, used[:n_consts]) if u)
    dce = dce.replace(invars=[v for v, u in zip(dce.invars, used) if u])
    avals = closed.out_avals[n_out:]
    return SplitVJP(closed, trees["vjp"], trees["out"], kept, again, dce, consts,
                    tuple(used[n_consts:n_consts + n_known]), tuple(avals[k] for k in kept))
