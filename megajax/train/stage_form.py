"""The train state's stacks of layers in the pipeline's stage form, and back.

With pipeline parallelism the train state holds every stack of layers (parameters, optimizer
state, the fp32 master copy, a frozen base) in the stage form of the run's layout
(megajax/models/layer_plan.py StagePlan): stage s's rows are its chunks' layers, then zero rows
that pad every stage to the same count, so the step's stage loop finds each chunk's layers on its
own devices and nothing moves between stages to put them there. A padding row is never run: its
gradient is exactly zero, and so its optimizer state and weight (AdamW: zero moments, zero
update, a decay of zero) stay zero.

Everything outside the step sees the model's own form (`logical`: a stack's rows in model order):
checkpoints (so a checkpoint does not know the layout it was saved under, and resumes under
another), loads, evaluation and generation. The two conversions are gathers of rows along the
stacks' first dim:

    to_stages(tree, plan)      model order -> stage form (padding rows zero)
    from_stages(tree, plan)    stage form -> model order
    staged_structs(tree, plan) the stage form's ShapeDtypeStructs (shardings kept)

`tree` is a TrainState (or a part of one: its parameters); a leaf is converted when its path in the
state runs through one of the plan's stacks (`params`, `opt_state`, `frozen`; the FP8 scaling state
and the expert bias stay in model order: the step puts them into the stage form itself).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.tree_util import DictKey, GetAttrKey

from megajax.models.layer_plan import StagePlan, StageRows

# The TrainState fields whose stacks are kept in the stage form (the others are small and replicated).
STAGED_FIELDS = ("params", "opt_state", "frozen")


def _rows(path, plan: StagePlan, top: bool) -> StageRows | None:
    """The row space of the leaf at `path` (None: not a stacked leaf). `top`: the tree is a TrainState
    (only its STAGED_FIELDS count), else a parameter tree."""
    if top and not (path and isinstance(path[0], GetAttrKey) and path[0].name in STAGED_FIELDS):
        return None
    keys = tuple(e.key for e in path if isinstance(e, DictKey))
    kind = plan.kind_at(keys) if keys else None
    return None if kind is None else plan.kinds[kind]


def _is_state(tree) -> bool:
    return hasattr(tree, "opt_state") and hasattr(tree, "params")


def _map(fn, tree, plan: StagePlan):
    top = _is_state(tree)
    return jax.tree_util.tree_map_with_path(lambda path, x: fn(x, _rows(path, plan, top)), tree)


def to_stages(tree, plan: StagePlan | None):
    """`tree`'s stacked leaves (model order, [logical rows, ...]) in the stage form."""
    if plan is None:
        return tree

    def one(x, rows):
        if rows is None:
            return x
        zero = jnp.zeros((1,) + x.shape[1:], x.dtype)
        return jnp.take(jnp.concatenate([x, zero]), jnp.asarray(rows.to_stage_index()), axis=0)
    return _map(one, tree, plan)


def from_stages(tree, plan: StagePlan | None):
    """`tree`'s stacked leaves (stage form) in model order."""
    if plan is None:
        return tree
    return _map(lambda x, rows: x if rows is None else jnp.take(x, jnp.asarray(rows.to_logical_index()), axis=0),
                tree, plan)


def staged_structs(tree, plan: StagePlan | None):
    """A tree of ShapeDtypeStructs (model order) as the stage form holds them."""
    if plan is None:
        return tree

    def one(x, rows):
        if rows is None or not hasattr(x, "shape"):
            return x
        return jax.ShapeDtypeStruct((len(rows.rows),) + tuple(x.shape[1:]), x.dtype,
                                    sharding=getattr(x, "sharding", None), weak_type=getattr(x, "weak_type", False))
    return _map(one, tree, plan)
