"""The next token from logits: greedy, or sampled after temperature, top-k and top-p.

Filters apply in Hugging Face's order (temperature, then top-k, then top-p), with its
semantics: top-k keeps the tokens scoring at least the k-th highest score (ties kept); top-p
keeps the smallest set of highest-probability tokens, computed on the top-k-filtered
distribution, whose probability reaches p (the most likely token is always kept). Every row
has its own settings (a server batches requests that differ), and its own random key: the
draw at step s uses fold_in(key, s), so a seeded sequence is reproducible whatever batch it
shares. Presence and frequency penalties (OpenAI's) lower the logits of tokens already generated
before any of that, greedy decoding included.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp

from megajax.errors import UserError


# The accepted range of each setting (the one home: `megajax generate`'s flags and both server
# dialects are checked here): setting -> (test, what is accepted).
RANGES = {
    "temperature": (lambda v: 0.0 <= v < float("inf"), "must be a finite number >= 0 (0 is greedy decoding)"),
    "top_k": (lambda v: v >= 0, "must be >= 0 (0 keeps every token)"),
    "top_p": (lambda v: 0.0 < v <= 1.0, "must be in (0, 1] (1 keeps every token)"),
    "seed": (lambda v: 0 <= v < 2**63, "must be an integer in [0, 2^63)"),
    "presence_penalty": (lambda v: -2.0 <= v <= 2.0, "must be in [-2, 2] (0 is off)"),
    "frequency_penalty": (lambda v: -2.0 <= v <= 2.0, "must be in [-2, 2] (0 is off)"),
}


class SamplingError(UserError):
    """A sampling setting outside its range; `field` names the Sampling field."""

    def __init__(self, message: str, field: str):
        super().__init__(message)
        self.field = field


@dataclass(frozen=True)
class Sampling:
    """How one sequence picks its tokens. temperature 0 is greedy (top-k / top-p unused);
    top_k 0 and top_p 1 switch those filters off; penalties 0 are off."""
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0

    def check(self, names: dict[str, str] | None = None) -> "Sampling":
        """Raises SamplingError (a UserError) naming the setting (as `names` calls it: a flag or a
        request field), its value and RANGES' accepted values."""
        for field, (ok, accepted) in RANGES.items():
            value = getattr(self, field)
            if not ok(value):
                raise SamplingError(f"{(names or {}).get(field, field)}={value}: {accepted}.", field)
        return self


def seed_key_data(seed: int) -> tuple[int, int]:
    """A 64-bit seed as threefry key data (two uint32 words)."""
    return (seed >> 32) & 0xFFFFFFFF, seed & 0xFFFFFFFF


def filter_logits(logits_BxV: jax.Array, top_k_B: jax.Array, top_p_B: jax.Array) -> jax.Array:
    """Logits (already temperature-scaled, fp32) with everything outside each row's top-k, then
    top-p, set to -inf. top_k 0 / top_p >= 1: that filter is off for the row."""
    v = logits_BxV.shape[-1]
    desc = -jnp.sort(-logits_BxV, axis=-1)  # [B, V] highest first
    k = jnp.where(top_k_B > 0, jnp.minimum(top_k_B, v), v)
    kth = jnp.take_along_axis(desc, (k - 1)[:, None], axis=-1)  # [B, 1]
    desc = jnp.where(desc >= kth, desc, -jnp.inf)
    probs = jax.nn.softmax(desc, axis=-1)
    mass_before = jnp.cumsum(probs, axis=-1) - probs  # probability of the higher-ranked tokens
    keep = (mass_before < top_p_B[:, None]) | (top_p_B[:, None] >= 1.0)  # a prefix of the ranking
    kept = jnp.maximum(jnp.sum(keep, axis=-1), 1)
    smallest_kept = jnp.take_along_axis(desc, (kept - 1)[:, None], axis=-1)  # [B, 1]
    keep_all = (logits_BxV >= kth) & (logits_BxV >= smallest_kept)
    return jnp.where(keep_all, logits_BxV, -jnp.inf)


def apply_penalties(logits_BxV: jax.Array, tokens_BxS: jax.Array, count: jax.Array, presence_B: jax.Array,
                    frequency_B: jax.Array) -> jax.Array:
    """OpenAI's penalties: logit[j] - frequency * c[j] - presence * (c[j] > 0), where c[j] counts token j
    among the first `count` ([] or per row [B]) generated tokens (`tokens_BxS`; the prompt does not count). Computed only
    when some row has a penalty."""
    def penalised():
        b, s = tokens_BxS.shape
        generated = (jnp.arange(s)[None, :] < jnp.reshape(count, (-1, 1))).astype(jnp.float32)  # [B, S]
        counts = jnp.zeros(logits_BxV.shape, jnp.float32).at[jnp.arange(b)[:, None], tokens_BxS].add(generated)
        return (logits_BxV - frequency_B[:, None] * counts
                - presence_B[:, None] * (counts > 0).astype(jnp.float32)).astype(logits_BxV.dtype)

    on = jnp.any((presence_B != 0) | (frequency_B != 0))
    return jax.lax.cond(on, penalised, lambda: logits_BxV)


def next_tokens(logits_BxV: jax.Array, keys_Bx2: jax.Array, step: jax.Array, temperature_B: jax.Array,
                top_k_B: jax.Array, top_p_B: jax.Array) -> jax.Array:
    """Token ids [B] int32: argmax where temperature is 0, else a draw from the filtered softmax.

    `keys_Bx2` is each row's raw threefry key data (uint32); `step` the sequence's token index ([] or
    per row [B]).
    The sort that top-k / top-p need runs only when some row asks for them."""
    logits = logits_BxV.astype(jnp.float32)
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    sampling = temperature_B > 0

    def draw():
        scaled = logits / jnp.where(sampling, temperature_B, 1.0)[:, None]
        filtering = jnp.any(sampling & ((top_k_B > 0) | (top_p_B < 1.0)))
        scaled = jax.lax.cond(filtering, lambda: filter_logits(scaled, top_k_B, top_p_B), lambda: scaled)
        steps = jnp.broadcast_to(step, keys_Bx2.shape[:1])
        keys = jax.vmap(lambda k, s: jax.random.fold_in(jax.random.wrap_key_data(k), s))(keys_Bx2, steps)
        return jax.vmap(jax.random.categorical)(keys, scaled).astype(jnp.int32)

    drawn = jax.lax.cond(jnp.any(sampling), draw, lambda: greedy)
    return jnp.where(sampling, drawn, greedy)
