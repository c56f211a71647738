"""Dynamic loss scaling for fp16 training, with Megatron's conventions.

A step whose gradients hold inf/nan is skipped. Each such step spends one
unit of hysteresis; when hysteresis runs out the scale is multiplied by
`backoff` (never below `min_scale`). After `window` consecutive clean steps
the scale grows by `growth` and hysteresis is restored.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import struct


@struct.dataclass
class LossScaleState:
    scale: jax.Array  # f32 []
    growth_tracker: jax.Array  # i32 []: clean steps since the last overflow/growth
    hysteresis_tracker: jax.Array  # i32 []: overflows left before backing off


@dataclasses.dataclass(frozen=True)
class DynamicLossScale:
    initial_scale: float = 2.0 ** 32
    min_scale: float = 1.0
    window: int = 1000
    hysteresis: int = 2
    growth: float = 2.0
    backoff: float = 0.5

    def init(self) -> LossScaleState:
        return LossScaleState(scale=jnp.asarray(self.initial_scale, jnp.float32),
                              growth_tracker=jnp.asarray(0, jnp.int32),
                              hysteresis_tracker=jnp.asarray(self.hysteresis, jnp.int32))

    def update(self, state: LossScaleState, found_inf: jax.Array) -> LossScaleState:
        # Overflow: spend hysteresis; back off once it is used up.
        hyst_after_inf = state.hysteresis_tracker - 1
        scale_after_inf = jnp.where(hyst_after_inf <= 0,
                                    jnp.maximum(state.scale * self.backoff, self.min_scale), state.scale)
        # Clean step: grow after `window` clean steps in a row.
        growth = state.growth_tracker + 1
        grow = growth >= self.window
        scale_after_ok = jnp.where(grow, state.scale * self.growth, state.scale)
        return LossScaleState(
            scale=jnp.where(found_inf, scale_after_inf, scale_after_ok),
            growth_tracker=jnp.where(found_inf | grow, 0, growth).astype(jnp.int32),
            hysteresis_tracker=jnp.where(found_inf, hyst_after_inf,
                                         jnp.where(grow, self.hysteresis, state.hysteresis_tracker)
                                         ).astype(jnp.int32),
        )
