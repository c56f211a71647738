"""Sampling: Hugging Face's filters in its order, per-row settings and keys, the drawn distribution."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from megajax.errors import UserError
from megajax.inference.sampling import Sampling, filter_logits, next_tokens, seed_key_data

V = 40


def hf_probs(logits, temperature, top_k, top_p):
    """transformers' warpers (temperature, then top-k, then top-p) applied to `logits` [B, V]: the
    distribution `generate(do_sample=True)` draws from."""
    torch = pytest.importorskip("torch")
    lp = pytest.importorskip("transformers.generation.logits_process")
    scores = torch.from_numpy(np.asarray(logits, np.float32))
    warpers = [lp.TemperatureLogitsWarper(temperature)]
    if top_k:
        warpers.append(lp.TopKLogitsWarper(top_k))
    if top_p < 1.0:
        warpers.append(lp.TopPLogitsWarper(top_p))
    for w in warpers:
        scores = w(None, scores)
    return torch.softmax(scores, dim=-1).numpy()


def ours_probs(logits, temperature, top_k, top_p):
    b = logits.shape[0]
    scaled = jnp.asarray(logits, jnp.float32) / temperature
    kept = filter_logits(scaled, jnp.full((b,), top_k, jnp.int32), jnp.full((b,), top_p, jnp.float32))
    return np.asarray(jax.nn.softmax(kept, axis=-1))


@pytest.mark.parametrize("temperature,top_k,top_p", [(1.0, 0, 1.0), (0.7, 5, 1.0), (1.3, 0, 0.8),
                                                     (0.5, 12, 0.6), (2.0, 3, 0.99), (1.0, 1, 1.0)])
def test_filters_equal_transformers_warpers(temperature, top_k, top_p):
    logits = np.random.default_rng(0).normal(0, 2.0, (6, V))
    np.testing.assert_allclose(ours_probs(logits, temperature, top_k, top_p),
                               hf_probs(logits, temperature, top_k, top_p), atol=1e-6)


def _draw(logits_V, n, temperature, top_k, top_p, step=0):
    rows = jnp.broadcast_to(jnp.asarray(logits_V, jnp.float32), (n, len(logits_V)))
    keys = jnp.asarray([seed_key_data(s) for s in range(n)], jnp.uint32)
    full = lambda x, dt: jnp.full((n,), x, dt)  # noqa: E731
    return np.asarray(jax.jit(next_tokens)(rows, keys, jnp.int32(step), full(temperature, jnp.float32),
                                           full(top_k, jnp.int32), full(top_p, jnp.float32)))


def test_drawn_tokens_follow_the_filtered_softmax():
    """20,000 draws at one step (one seed each): chi-square against transformers' distribution."""
    scipy_stats = pytest.importorskip("scipy.stats")
    logits = np.random.default_rng(1).normal(0, 1.5, V)
    for temperature, top_k, top_p in ((0.8, 10, 0.9), (1.2, 0, 1.0)):
        want = hf_probs(logits[None], temperature, top_k, top_p)[0]
        counts = np.bincount(_draw(logits, 20_000, temperature, top_k, top_p), minlength=V)
        support = want > 0
        assert counts[~support].sum() == 0  # never a filtered token
        expected = want[support].astype(np.float64) / want[support].sum() * counts.sum()
        statistic = np.sum((counts[support] - expected) ** 2 / expected)
        p_value = scipy_stats.chi2.sf(statistic, df=support.sum() - 1)
        assert p_value > 1e-3, (temperature, top_k, top_p, p_value)


def test_greedy_rows_top_k_1_and_sampling_rows_share_a_batch():
    logits = jnp.asarray(np.random.default_rng(2).normal(0, 1.0, (4, V)), jnp.float32)
    keys = jnp.asarray([seed_key_data(s) for s in (1, 2, 3, 4)], jnp.uint32)
    tokens = next_tokens(logits, keys, jnp.int32(5), jnp.asarray([0.0, 1.5, 1.0, 3.0]),
                         jnp.asarray([0, 1, 0, 0]), jnp.asarray([1.0, 1.0, 1.0, 1.0]))
    greedy = np.argmax(np.asarray(logits), axis=-1)
    assert tokens[0] == greedy[0] and tokens[1] == greedy[1]  # temperature 0; top-k 1 at temperature 1.5
    again = next_tokens(logits, keys, jnp.int32(5), jnp.asarray([0.0, 1.5, 1.0, 3.0]),
                        jnp.asarray([0, 1, 0, 0]), jnp.asarray([1.0, 1.0, 1.0, 1.0]))
    np.testing.assert_array_equal(tokens, again)  # seeded: reproducible
    draws = {int(_draw(np.asarray(logits[3]), 1, 3.0, 0, 1.0, step)[0]) for step in range(20)}
    assert len(draws) > 3  # the step changes the draw


def test_settings_are_checked_naming_them():
    with pytest.raises(UserError, match="--top-p=0"):
        Sampling(top_p=0.0).check({"top_p": "--top-p"})
    with pytest.raises(UserError, match="temperature=-1"):
        Sampling(temperature=-1.0).check()
    with pytest.raises(UserError, match="top_k=-2"):
        Sampling(top_k=-2).check()


def test_every_range_names_the_setting_and_what_is_accepted():
    from megajax.inference.sampling import RANGES, SamplingError
    bad = {"temperature": float("inf"), "top_k": -1, "top_p": 1.5, "seed": 2**63, "presence_penalty": 2.5,
           "frequency_penalty": -3.0}
    assert set(bad) == set(RANGES)
    for field, value in bad.items():
        with pytest.raises(SamplingError) as e:
            Sampling(**{field: value}).check({field: f"--{field}"})
        assert e.value.field == field and str(e.value) == f"--{field}={value}: {RANGES[field][1]}."


@pytest.mark.parametrize("jit", [False, True])
def test_penalties_count_only_the_generated_tokens(jit):
    """OpenAI's formula: logit - frequency * count - presence * (count > 0), counting the first `count` new
    tokens; rows without penalties are unchanged."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from megajax.inference.sampling import apply_penalties
    logits = jnp.zeros((2, 5), jnp.float32)
    tokens = jnp.array([[1, 1, 3, 4], [2, 2, 2, 2]], jnp.int32)  # [B, S]; step 3 not generated yet
    fn = jax.jit(apply_penalties) if jit else apply_penalties
    out = np.asarray(fn(logits, tokens, jnp.int32(3), jnp.array([0.5, 0.0]), jnp.array([1.0, 0.0])))
    np.testing.assert_allclose(out[0], [0, -2.5, 0, -1.5, 0])
    np.testing.assert_allclose(out[1], 0)
