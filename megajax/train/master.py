"""The optimizer's fp32 master copy of 16-bit parameters (precision.param_dtype=compute) where
parameters come from elsewhere: loads that seed it, and resumes from checkpoints with or without it.

    load_target(logical)                  the parameters as loads read them (fp32 where a copy is kept)
    with_params(state, params, ...)       a state with loaded parameters: the copy, and its rounding
    restore_resume(step_dir, ...)         a checkpoint's state, converted when it holds the other form

A checkpoint of fp32 parameters without a copy (precision.param_dtype=fp32, fp32 runs, and every
checkpoint written before the copy existed) resumes into a run that keeps one: its parameters become
the copy, the run's parameters their rounding. A checkpoint with a copy resumes into a run without
one: the copy becomes the parameters. Either way the next update is the one the saving run would
have made, but for the rounding of the parameters the forward pass already used.
"""

from __future__ import annotations

from pathlib import Path

import jax
import jax.numpy as jnp

from megajax.checkpoint.manager import master_prefix, restore_state, stored_arrays
from megajax.config import Config
from megajax.train.optimizer import MasterParams, master_of
from megajax.train.state import TrainState, pad_state, unpad_state


def _as(tree, dtype):
    return jax.tree.map(lambda t: jax.ShapeDtypeStruct(t.shape, dtype, sharding=t.sharding), tree)


def load_target(logical: TrainState) -> dict:
    """The parameters' logical target (ShapeDtypeStructs with shardings) as loads read them: fp32
    where the optimizer keeps an fp32 master copy (which they seed: with_params), else the state's."""
    return logical.params if master_of(logical.opt_state) is None else _as(logical.params, jnp.float32)


def with_params(state: TrainState, params: dict, logical: TrainState, shardings: TrainState) -> TrainState:
    """`state` (stored) with loaded parameters `params` (stored, load_target's dtypes): they are the
    master copy where the optimizer keeps one, and the parameters are their rounding."""
    if master_of(logical.opt_state) is None:
        return state.replace(params=params)

    def rest(tree):  # all but the parameters, the frozen base and the copy
        return tree.replace(params=None, frozen=None, opt_state=tree.opt_state[:-1])

    def put(stored, params):
        st, p = unpad_state(stored, rest(logical)), unpad_state(params, load_target(logical))
        st = st.replace(params=jax.tree.map(lambda x, t: x.astype(t.dtype), p, logical.params),
                        opt_state=(*st.opt_state, MasterParams(p)))
        return pad_state(st, logical.replace(frozen=None))

    out = jax.jit(put, out_shardings=shardings.replace(frozen=None), donate_argnums=0)(rest(state), params)
    return out.replace(frozen=state.frozen)


def restore_resume(step_dir: Path, logical: TrainState, shardings: TrainState, cfg: Config) -> tuple[TrainState, str]:
    """The checkpoint's train state (no frozen base) laid out like `logical` (as stored), converted
    between the forms with and without the master copy; (state, note or '')."""
    target = logical.replace(frozen=None)
    ours = master_of(target.opt_state) is not None
    theirs = master_prefix(stored_arrays(step_dir)[0]) is not None
    if ours == theirs:
        return restore_state(step_dir, target, cfg)
    if theirs:  # the copy becomes the parameters
        saved = target.replace(opt_state=(*target.opt_state, MasterParams(_as(target.params, jnp.float32))))
        state, note = restore_state(step_dir, saved, cfg)
        state = state.replace(params=state.opt_state[-1].master, opt_state=state.opt_state[:-1])
        return state, _joined(note, "the checkpoint's fp32 master parameters are the parameters (precision."
                                    "param_dtype=fp32, or an fp32 run)")
    saved = target.replace(params=_as(target.params, jnp.float32), opt_state=target.opt_state[:-1])
    state, note = restore_state(step_dir, saved, cfg)
    state = with_params(state.replace(opt_state=(*state.opt_state, None)), state.params, logical, shardings)
    return state, _joined(note, f"the checkpoint's fp32 parameters are the optimizer's master copy, the "
                                f"parameters their {jnp.dtype(jax.tree.leaves(target.params)[0].dtype).name} "
                                f"rounding (precision.param_dtype=compute)")


def _joined(note: str, more: str) -> str:
    return f"{note}; {more}" if note else more
