"""Text generation with a KV cache: ragged prompts prefilled in one pass, then a jitted decode loop.

    Generator(model cfg, params, mesh, rules)
      .start(prompts, samplings, budgets) -> DecodeState   prefill; the first new token sampled
      .advance(state, stop) -> DecodeState                  decode until `stop` tokens or every row is done
      .generate(prompts, ...) -> (completions, timing)      both, timed

The cache holds, for k and for v, `[layers, batch, kv_heads, slots, head_dim]`: one array
carried through the scanned layers, or (the default, `layer_buffers`) one
`[batch, kv_heads, slots, head_dim]` array per layer beside per-layer weights, which a decode
step reads in place (Transformer.extend). Head-major, so that each (sequence, kv head) reads its
slots contiguously: with slots before heads, XLA:CPU copies a transposed cache every step.
A multi-latent attention layer caches its latent and rope key instead, `[batch, slots, features]`
each (megajax/models/mla.py); Transformer's `layer_caches` gives each layer's shapes. A hybrid model's
Mamba layers keep a MambaState instead (conv windows and SSM state, [batch, ...] whatever the length;
as cache_k, cache_v None) and its MLP and MoE layers nothing (None); stacked, its caches are a list
over the pattern's group of caches stacked over the groups.

Prompts are left-padded to a common length P, so at every step all sequences write the same
slot: slot P + i - 1 holds the input of new token i. A Mamba layer skips the left padding (it enters
neither its conv window nor its scan), so its state after the prefill is the prompt's alone.
A sequence's positions (RoPE or learned) are its slots minus its padding, and it attends only
to its own slots, so it computes what it would alone. Decoding is one `lax.while_loop` (no host
round trip per token) over a donated cache, stopping each row at end-of-document or its token
budget; `advance` may be called in chunks (a server streams that way).

Every new token comes with its log-probability under the model's own distribution (a log-softmax of
the logits before temperature, filters and penalties), and, when a batch asks (`top_n`), the
`top_n` most likely tokens at its step; a prefill asked to (`score_prompt`) scores the prompt's
tokens the same way (OpenAI's `logprobs` and `echo`).

A vision-language model's prompts may come with images (`start(..., images=)`): the encoder and
projector run on them first (`image_features`), and the prefill puts their features in place of the
prompts' image placeholders (Transformer.extend's `image_features`), so the cache holds them.

Sharded like training: the batch over the data axes, kv_heads (and heads, mlp, vocab) over
`tensor`, through the rules table (`batch`, `cache_length`, ...). Shapes are bucketed (batch
to a power of two times the data-parallel size, prompt and new-token room to powers of two) so
that a handful of compilations serve every request.
"""

from __future__ import annotations

import functools
import math
import time
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx, struct
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from megajax.config import ModelConfig
from megajax.errors import UserError
from megajax.inference.sampling import Sampling, apply_penalties, next_tokens, seed_key_data
from megajax.mesh import Rules, activation_sharding, data_parallel_size, logical_constraint, logical_to_spec, mesh_sizes
from megajax.models import Transformer, param_axes
from megajax.models.attention import make_attention_core
from megajax.models.layout import STACK_NAMES, layer_slots
from megajax.models.layers import LinearOps
from megajax.models.transformer import layer_caches
from megajax.models.vision import build_model
from megajax.parallel.context import sharded_attention, sharded_ssd

MIN_BUCKET = 16  # the smallest padded prompt length and new-token room
MAX_TOP_LOGPROBS = 20  # the most likely tokens a step can report (a batch computes all of them or none)


class ContextLengthError(UserError):
    """A prompt plus its new tokens does not fit the model's context."""


@struct.dataclass
class DecodeState:
    cache_k: Any  # [layers, B, kv_heads, T, head_dim], or a list of per-layer [B, kv_heads, T, head_dim]; T = P + S
    cache_v: Any
    tokens: jax.Array  # i32 [B, S]: new tokens, in order
    count: jax.Array  # i32 []: new tokens so far (all rows advance together)
    done: jax.Array  # bool [B]
    pad: jax.Array  # i32 [B]: left padding of each prompt (P - its length)
    length: jax.Array  # i32 [B]: each prompt's length (its first new token's input sits at position length)
    budget: jax.Array  # i32 [B]: most new tokens of each row
    temperature: jax.Array  # f32 [B]
    top_k: jax.Array  # i32 [B]
    top_p: jax.Array  # f32 [B]
    keys: jax.Array  # u32 [B, 2]: each row's threefry key data
    presence: jax.Array  # f32 [B]: presence penalty
    frequency: jax.Array  # f32 [B]: frequency penalty
    logprobs: jax.Array  # f32 [B, S]: log p of each new token (the model's distribution)
    top_ids: jax.Array  # i32 [B, S, N]: the N (top_n, 0 or MAX_TOP_LOGPROBS) most likely tokens at each step
    top_logprobs: jax.Array  # f32 [B, S, N]
    prompt_logprobs: jax.Array  # f32 [B, P'] (P' = P when the prompt is scored, else 0): log p of prompt token j
    prompt_top_ids: jax.Array  # i32 [B, P', N]: the most likely tokens at prompt position j (column 0 unused)
    prompt_top_logprobs: jax.Array  # f32 [B, P', N]


STATE_AXES = dict(tokens=("batch", None), count=(), done=("batch",),
                  pad=("batch",), length=("batch",), budget=("batch",), temperature=("batch",), top_k=("batch",),
                  top_p=("batch",), keys=("batch", None), presence=("batch",), frequency=("batch",),
                  logprobs=("batch", None), top_ids=("batch", None, None), top_logprobs=("batch", None, None),
                  prompt_logprobs=("batch", None), prompt_top_ids=("batch", None, None),
                  prompt_top_logprobs=("batch", None, None))
SCORE_FIELDS = ("logprobs", "top_ids", "top_logprobs", "prompt_logprobs", "prompt_top_ids", "prompt_top_logprobs")


@dataclass
class TokenScores:
    """Log-probabilities of a run of tokens under the model's distribution: `logprobs[i]` of token i,
    `top[i]` the most likely (id, logprob) pairs at its position, best first (empty when not asked)."""
    logprobs: list[float]
    top: list[list[tuple[int, float]]]

    def __getitem__(self, part: slice) -> "TokenScores":
        return TokenScores(self.logprobs[part], self.top[part])

    @classmethod
    def of(cls, scores: dict[str, np.ndarray], row: int, part: slice, prefix: str = "") -> "TokenScores":
        """Row `row`, positions `part` of Generator.read_scores' arrays (`prefix` "prompt_": the prompt's)."""
        ids, lps = scores[prefix + "top_ids"][row, part], scores[prefix + "top_logprobs"][row, part]
        return cls([float(x) for x in scores[prefix + "logprobs"][row, part]],
                   [[(int(t), float(v)) for t, v in zip(i, lp)] for i, lp in zip(ids, lps)])


@dataclass
class Completion:
    prompt_ids: list[int]
    completion_ids: list[int]  # ends with the end-of-document id when finish_reason is "stop"
    finish_reason: str  # "stop" (end of document) or "length" (token budget)
    scores: TokenScores | None = None  # of completion_ids
    prompt_scores: TokenScores | None = None  # of prompt_ids[1:] (the first token has no context), when asked


@dataclass
class Timing:
    compile_s: float  # compilations this call needed (0 when cached)
    time_to_first_token_s: float  # prefill + first token, compiled
    decode_s: float
    decode_tokens: int  # tokens after the first, all sequences together
    batch: int  # sequences run together (before padding)

    @property
    def decode_tokens_per_s(self) -> float:
        return self.decode_tokens / self.decode_s if self.decode_s > 0 else 0.0


def fp32_accumulating_dot(x, w, dimension_numbers, precision=None, preferred_element_type=None):
    """A projection in the operands' dtype with fp32 accumulation, rounded back to that dtype.

    The same function as a plain dot_general for fp32; for bf16 it is how a CPU runs bf16
    products fast (XLA:CPU's bf16 x bf16 -> fp32 kernels), and what GPUs do internally."""
    out = jax.lax.dot_general(x, w, dimension_numbers, precision=precision, preferred_element_type=jnp.float32)
    return out.astype(jnp.result_type(x, w))


def generation_attention(impl: str, mesh: Mesh | None = None, rules: Rules | None = None) -> Callable:
    """The attention core a prefill runs: model.attention_impl on a GPU (per shard under a mesh, like
    training's), plain XLA on a CPU (where the Pallas kernel would run interpreted). Decode steps
    attend over the cache in plain jnp whatever this is (cached_attention)."""
    platform = (mesh.devices.flat[0] if mesh is not None else jax.devices()[0]).platform
    if platform == "cpu" or (impl == "cudnn" and platform != "gpu"):
        impl = "xla"
    core = make_attention_core(impl, "none")
    if impl != "xla" and mesh is not None and mesh.devices.size > 1:
        core = sharded_attention(core, mesh, generation_rules(rules))
    return core


def generation_ssd(impl: str, mesh: Mesh | None = None, rules: Rules | None = None,
                   platform: str | None = None) -> Callable | None:
    """The SSD scan a Mamba layer's prefill (or prefill chunk) runs from its carried state:
    model.mamba_ssd_impl's Pallas kernels on a GPU (per shard under a mesh, like training's), the
    chunked jnp form (None: the model's default) on a CPU, where the kernels would run interpreted.
    `platform`: the devices' (default: the mesh's, or the default device's). A decode step runs the
    one-token recurrence whatever this is."""
    platform = platform or (mesh.devices.flat[0] if mesh is not None else jax.devices()[0]).platform
    if impl == "xla" or platform == "cpu":
        return None
    from pallas_kernels.ssd import ssd
    if mesh is not None and mesh.devices.size > 1:
        return sharded_ssd(ssd, mesh, generation_rules(rules))
    return ssd


def generation_model(model: ModelConfig, padded_vocab_size: int, dtype, attention_core: Callable | None = None,
                     ssd: Callable | None = None) -> tuple:
    """(graphdef, logical axes, abstract params) of the model with plain products: generation
    needs none of training's (sequence-parallel collectives, CPU backward products). `ssd`: the
    Mamba layers' scan (generation_ssd; None: the chunked jnp form)."""
    def make():
        dot = fp32_accumulating_dot
        return build_model(model, padded_vocab_size=padded_vocab_size, dtype=dtype, ops=LinearOps(column=dot, row=dot),
                           attention_core=attention_core or make_attention_core("xla", "none"), vision_dot=dot,
                           ssd=ssd, rngs=nnx.Rngs(0))
    abstract = nnx.eval_shape(make)
    graphdef, state = nnx.split(abstract)
    return graphdef, param_axes(abstract), nnx.to_pure_dict(state)


def token_scores(logits: jax.Array, tokens: jax.Array, top_n: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(log p of `tokens`, ids and log p of the `top_n` most likely tokens) under log_softmax(logits),
    in fp32: logits [..., V], tokens [...] -> [...], [..., top_n], [..., top_n]."""
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    chosen = jnp.take_along_axis(logp, tokens[..., None].astype(jnp.int32), axis=-1)[..., 0]
    if not top_n:
        empty = logp[..., :0]
        return chosen, empty.astype(jnp.int32), empty
    top_logp, top_ids = jax.lax.top_k(logp, top_n)
    return chosen, top_ids.astype(jnp.int32), top_logp


def generation_rules(activations: Rules) -> Rules:
    """Activation rules for generation: the sequence is never split (a decode step has one token)."""
    return {**activations, "length": (), "residual_length": ()}


@functools.partial(jax.jit, static_argnames=("dtype", "slots"))
def _split_layers(params: dict, dtype, slots: tuple) -> tuple[dict, list]:
    cast = functools.partial(jax.tree.map, lambda p: p.astype(dtype))
    stacks = {stack.rstrip("/") for stack, _ in slots}
    return (cast({k: v for k, v in params.items() if k not in stacks}),
            [cast(jax.tree.map(lambda p, i=i: p[i], params[stack.rstrip("/")])) for stack, i in slots])


def split_layers(params: dict, model: ModelConfig, dtype=jnp.float32) -> tuple[dict, list]:
    """(the parameters other than the blocks', one dict per block in model order), in `dtype`: each
    layer in its own buffers, stored in the compute dtype.

    A decode step reads every weight once, so its time is the weights' bytes: on CPU a product
    cannot read one layer of a stacked `[layers, ...]` tensor in place (a scanned step copies each
    layer's weights first, every step), and fp32 master weights cast to bf16 on use would be read
    in fp32 and written again, every step."""
    return _split_layers(params, jnp.dtype(dtype), tuple(generation_slots(model)))


def generation_slots(model: ModelConfig) -> list[tuple[str, int]]:
    """The stacked blocks one at a time, as generation reads them: each layer (layout.layer_slots), or a
    hybrid's groups (the layers of one repeat of its pattern, which `layers` stacks)."""
    if model.hybrid_layer_pattern:
        return [("layers/", g) for g in range(model.num_layers // len(model.hybrid_group()))]
    return layer_slots(model)


def length_bucket(n: int) -> int:
    """Padded prompt length / new-token room for n: a power of two, at least MIN_BUCKET (a server sees
    a few shapes, so a few compilations)."""
    return max(MIN_BUCKET, 1 << max(0, math.ceil(math.log2(n))))


def batch_bucket(n: int, data_parallel: int) -> int:
    """Rows a batch of n sequences runs with: a power of two, times the data-parallel size."""
    per_rank = -(-n // data_parallel)
    return (1 << max(0, math.ceil(math.log2(per_rank)))) * data_parallel


class Generator:
    """Cached generation for one model on one mesh (or one device when `mesh` is None).

    `params` is the pure parameter dict (placed as the caller likes: the rules' shardings, or a
    training state's); `rules` the activation rules (megajax.mesh.make_rules(cfg).activations).
    `eod_id` ends a sequence (None: only the budget does). `expert_bias` [layers, E]: the MoE
    routers' expert bias (aux-loss-free balancing), None without one."""

    def __init__(self, model: ModelConfig, params: dict, *, padded_vocab_size: int | None = None,
                 dtype=jnp.float32, mesh: Mesh | None = None, rules: Rules | None = None,
                 eod_id: int | None = None, layer_buffers: bool = True, expert_bias=None):
        if mesh is not None and rules is None:
            raise ValueError("a Generator on a mesh needs the activation rules table (make_rules(cfg).activations)")
        self.model = model
        self.dtype = dtype
        core = generation_attention(model.attention_impl, mesh, rules)
        self.graphdef, self.axes, self.abstract_params = generation_model(
            model, padded_vocab_size or model.padded_vocab_size(), dtype, core,
            generation_ssd(model.mamba_ssd_impl, mesh, rules))
        self.layer_buffers = layer_buffers
        self.params = split_layers(params, model, dtype) if layer_buffers else params
        self.mesh = mesh
        self.rules = generation_rules(rules) if rules is not None else None
        self.eod_id = eod_id
        # A few numbers per layer, used by every device: a constant of the compiled programs.
        self.expert_bias = None if expert_bias is None else np.asarray(expert_bias, np.float32)
        self.context = model.max_position_embeddings
        self.layers = layer_caches(model)  # each layer's cache: a k and a v, or multi-latent attention's latent
        self.data_parallel = data_parallel_size(mesh_sizes(mesh)) if mesh is not None else 1
        self._compiled: dict = {}
        self.compile_s = 0.0  # seconds spent compiling so far
        if mesh is not None:
            sh = {k: NamedSharding(mesh, logical_to_spec(v, self.rules)) for k, v in STATE_AXES.items()}
            for which in "kv":
                sh[f"cache_{which}"] = jax.tree.map(lambda a: NamedSharding(mesh, logical_to_spec(a, self.rules)),
                                                    self._cache_axes(which), is_leaf=lambda a: type(a) is tuple)
            self._state_sh = DecodeState(**sh)
            self._replicated = NamedSharding(mesh, P())
        else:
            self._state_sh = self._replicated = None
        self._prefill = jax.jit(self._prefill_fn, static_argnames=("room", "top_n", "score_prompt"),
                                out_shardings=self._state_sh)
        self._advance = jax.jit(self._advance_fn, donate_argnums=(1,), out_shardings=self._state_sh)
        self._gather = jax.jit(lambda x: x, out_shardings=self._replicated)
        self._features = jax.jit(self._features_fn, out_shardings=self._replicated)

    # ------------------------------------------------------------------ traced

    def _model(self, params) -> tuple[Transformer, list | None]:
        """The model and, with per-layer buffers, the blocks' parameters one layer at a time (the
        stacked `layers` in the model stay abstract: Transformer.extend reads only its structure)."""
        if not self.layer_buffers:
            return nnx.merge(self.graphdef, params), None
        rest, layers = params
        stacks = {k: v for k, v in self.abstract_params.items() if k in STACK_NAMES}
        return nnx.merge(self.graphdef, {**rest, **stacks}), layers

    def _expert_bias(self) -> jax.Array | None:
        return None if self.expert_bias is None else jnp.asarray(self.expert_bias)

    def _stacked_layers(self) -> list:
        """The caches a stacked cache holds (`layer_buffers` false): one stacked over every layer (each
        layer's alike), or for a hybrid one per layer of the pattern's group, stacked over the groups."""
        if self.model.hybrid_layer_pattern:
            return self.layers[:len(self.model.hybrid_group())]
        return self.layers[:1]

    def _cache_axes(self, which: str):
        """The logical axes of the `which` ("k" or "v") caches: per layer, or stacked."""
        if self.layer_buffers:
            return [layer.cache_axes(which) for layer in self.layers]
        stacked = [jax.tree.map(lambda a: ("layers",) + a, layer.cache_axes(which), is_leaf=lambda a: type(a) is tuple)
                   for layer in self._stacked_layers()]
        return stacked if self.model.hybrid_layer_pattern else stacked[0]

    def _empty_cache(self, b: int, t: int, which: str):
        """Empty `which` ("k" or "v") caches of b sequences of t slots: per layer (its own shape, e.g. a
        multi-latent layer's [B, T, kv_lora_rank], a Mamba layer's state), or stacked."""
        if self.layer_buffers:
            return [layer.empty(which, b, t, self.dtype) for layer in self.layers]
        count = len(self.layers) // len(self._stacked_layers())
        stacked = [jax.tree.map(lambda x: jnp.broadcast_to(x, (count,) + x.shape), layer.empty(which, b, t, self.dtype))
                   for layer in self._stacked_layers()]
        stacked = jax.tree.map(logical_constraint, stacked, self._cache_axes(which) if self.model.hybrid_layer_pattern
                               else [self._cache_axes(which)], is_leaf=lambda a: type(a) is tuple)
        return stacked if self.model.hybrid_layer_pattern else stacked[0]

    def _prompt_room(self, state: DecodeState) -> int:
        """P: the cache slots before the first new token's input (0 for a model without attention layers:
        nothing it keeps has slots)."""
        # T from an attention layer's cache: [(layers,) B, kv_heads, T, head_dim], or [(layers,) B, T,
        # kv_lora_rank] (multi-latent)
        caches = state.cache_k if isinstance(state.cache_k, list) else [state.cache_k]
        slots = [c.shape[-2] for c in caches if isinstance(c, jax.Array)]
        return slots[0] - state.tokens.shape[1] if slots else 0

    def _is_eod(self, tokens):
        return jnp.zeros(tokens.shape, bool) if self.eod_id is None else tokens == self.eod_id

    def _features_fn(self, params, images_NxHxWxC):
        with activation_sharding(self.mesh, self.rules):
            model, _ = self._model(params)
            return model.image_embeddings(images_NxHxWxC[None])[0]

    def _prefill_fn(self, params, tokens_BxP, pad_B, budget_B, temperature_B, top_k_B, top_p_B, keys_Bx2,
                    presence_B, frequency_B, features_BxMxD=None, *, room: int, top_n: int,
                    score_prompt: bool) -> DecodeState:
        with activation_sharding(self.mesh, self.rules):
            model, layers = self._model(params)
            b, p = tokens_BxP.shape
            t = p + room
            cache_k, cache_v = self._empty_cache(b, t, "k"), self._empty_cache(b, t, "v")
            positions = jnp.maximum(jnp.arange(p)[None, :] - pad_B[:, None], 0)
            key_mask = jnp.arange(t)[None, :] >= pad_B[:, None]
            logits, cache_k, cache_v = model.extend(tokens_BxP, positions, cache_k, cache_v, start=0,
                                                    key_mask_BxT=key_mask, layer_params=layers,
                                                    expert_bias=self._expert_bias(), all_positions=score_prompt,
                                                    image_features=features_BxMxD)
            if score_prompt:  # logits [B, P, V]: position j - 1 predicts prompt token j
                prompt = token_scores(logits[:, :-1], tokens_BxP[:, 1:], top_n)
                prompt = [jnp.concatenate([jnp.zeros_like(x[:, :1]), x], axis=1) for x in prompt]  # [B, P, ...]
                logits = logits[:, -1]
            else:
                prompt = [jnp.zeros((b, 0), jnp.float32), jnp.zeros((b, 0, top_n), jnp.int32),
                          jnp.zeros((b, 0, top_n), jnp.float32)]
            first = next_tokens(logits, keys_Bx2, jnp.int32(0), temperature_B, top_k_B, top_p_B)
            chosen, top_ids, top_logp = token_scores(logits, first, top_n)
            tokens = jnp.zeros((b, room), jnp.int32).at[:, 0].set(first)
            logprobs = jnp.zeros((b, room), jnp.float32).at[:, 0].set(chosen)
            top_ids = jnp.zeros((b, room, top_n), jnp.int32).at[:, 0].set(top_ids)
            top_logp = jnp.zeros((b, room, top_n), jnp.float32).at[:, 0].set(top_logp)
            return DecodeState(cache_k=cache_k, cache_v=cache_v, tokens=tokens, count=jnp.int32(1),
                               done=(budget_B <= 1) | self._is_eod(first), pad=pad_B, length=p - pad_B,
                               budget=budget_B,
                               temperature=temperature_B, top_k=top_k_B, top_p=top_p_B, keys=keys_Bx2,
                               presence=presence_B, frequency=frequency_B, logprobs=logprobs, top_ids=top_ids,
                               top_logprobs=top_logp, prompt_logprobs=prompt[0], prompt_top_ids=prompt[1],
                               prompt_top_logprobs=prompt[2])

    def _advance_fn(self, params, state: DecodeState, stop) -> DecodeState:
        room = state.tokens.shape[1]
        p = self._prompt_room(state)
        t = p + room
        fill = self.eod_id if self.eod_id is not None else 0
        limit = jnp.minimum(stop, room)
        top_n = state.top_ids.shape[-1]

        def cond(s: DecodeState):
            return (s.count < limit) & ~jnp.all(s.done)

        def body(s: DecodeState) -> DecodeState:
            with activation_sharding(self.mesh, self.rules):
                model, layers = self._model(params)
                slot = p + s.count - 1  # the slot of the last new token, this step's input
                last = jax.lax.dynamic_slice_in_dim(s.tokens, s.count - 1, 1, axis=1)  # [B, 1]
                key_mask = jnp.arange(t)[None, :] >= s.pad[:, None]
                logits, cache_k, cache_v = model.extend(last, (s.length + s.count - 1)[:, None], s.cache_k, s.cache_v,
                                                        start=slot, key_mask_BxT=key_mask, layer_params=layers,
                                                        expert_bias=self._expert_bias())
                penalised = apply_penalties(logits, s.tokens, s.count, s.presence, s.frequency)
                tok = next_tokens(penalised, s.keys, s.count, s.temperature, s.top_k, s.top_p)
                tok = jnp.where(s.done, fill, tok)
                chosen, top_ids, top_logp = token_scores(logits, tok, top_n)

                def put(buffer, x):  # x [B, ...] into buffer [B, S, ...] at step `count`
                    return jax.lax.dynamic_update_slice_in_dim(buffer, x[:, None], s.count, axis=1)

                done = s.done | self._is_eod(tok) | (s.count + 1 >= s.budget)
                return s.replace(cache_k=cache_k, cache_v=cache_v, tokens=put(s.tokens, tok), count=s.count + 1,
                                 done=done, logprobs=put(s.logprobs, chosen), top_ids=put(s.top_ids, top_ids),
                                 top_logprobs=put(s.top_logprobs, top_logp))

        return jax.lax.while_loop(cond, body, state)

    # ------------------------------------------------------------------ host

    def check(self, prompts: Sequence[Sequence[int]], budgets: Sequence[int]) -> None:
        """ContextLengthError / UserError for a prompt that is empty or does not fit with its budget.
        A budget of 0 scores the prompt only (the prompt must fit the context)."""
        for i, (ids, n) in enumerate(zip(prompts, budgets)):
            if not len(ids):
                raise UserError(f"prompt {i} is empty (0 tokens); generation needs at least one prompt token.")
            if n < 0:
                raise UserError(f"the number of new tokens must be >= 0 (got {n} for prompt {i}).")
            if len(ids) + n <= self.context:
                continue
            room = self.context - len(ids)
            if room <= 0:
                raise ContextLengthError(
                    f"this model's context length is {self.context} tokens, but prompt {i} has {len(ids)} tokens"
                    + (" (over the context by itself)" if room < 0 else ", which leaves no room for a new token")
                    + "; shorten the prompt.")
            raise ContextLengthError(
                f"this model's context length is {self.context} tokens, but prompt {i} has {len(ids)} tokens "
                f"and asks for {n} new one{'s' * (n != 1)} ({len(ids) + n}); shorten the prompt or ask for at most "
                f"{room} new token{'s' * (room != 1)}.")

    def _put(self, x: np.ndarray, axes: tuple) -> jax.Array:
        if self.mesh is None:
            return jnp.asarray(x)
        return jax.device_put(x, NamedSharding(self.mesh, logical_to_spec(axes, self.rules)))

    def _compile(self, key, jitted, *args, **kwargs):
        if key not in self._compiled:
            t0 = time.perf_counter()
            self._compiled[key] = jitted.lower(*args, **kwargs).compile()
            self.compile_s += time.perf_counter() - t0
        return self._compiled[key]

    def image_features(self, images: np.ndarray) -> np.ndarray:
        """A vision-language model's projected features of `images` [N, image_size, image_size, 3]
        (megajax.inference.images.preprocess'd): [N x image_seq_length, hidden] on the host, in the
        compute dtype."""
        v = self.model.vision
        if v is None:
            raise UserError("this model has no image encoder (model.vision is unset): it takes text alone.")
        images = np.asarray(images, np.float32)
        if images.ndim != 4 or images.shape[1:] != (v.image_size, v.image_size, 3):
            raise UserError(f"images have shape {list(images.shape)}; expected [images, {v.image_size}, "
                            f"{v.image_size}, 3] (model.vision.image_size={v.image_size}).")
        x = self._put(images, (None, None, None, None))
        return np.asarray(self._compile(("features", images.shape[0]), self._features, self.params, x)(self.params, x))

    def check_images(self, prompts: Sequence[Sequence[int]], images: Sequence) -> None:
        """UserError unless each prompt holds image_seq_length placeholders per image that comes with it
        (and none without a vision model)."""
        v = self.model.vision
        for i, (ids, imgs) in enumerate(zip(prompts, images)):
            n = 0 if imgs is None else len(imgs)
            if v is None:
                if n:
                    raise UserError("this model has no image encoder (model.vision is unset): it takes text alone, "
                                    f"but prompt {i} comes with {n} image(s).")
                continue
            count = sum(1 for t in ids if t == v.image_token_id)
            if count != n * v.image_seq_length:
                raise UserError(f"prompt {i} holds {count} image placeholders (model.vision.image_token_id="
                                f"{v.image_token_id}) but comes with {n} {'tile' if v.tiled else 'image'}(s) x "
                                f"image_seq_length={v.image_seq_length} = {n * v.image_seq_length}.")

    def start(self, prompts: Sequence[Sequence[int]], samplings: Sequence[Sampling],
              budgets: Sequence[int], *, top_n: int = 0, score_prompt: bool = False,
              images: Sequence | None = None) -> DecodeState:
        """Prefill `prompts` (token ids, ragged) and pick each one's first new token (a budget of 0
        picks one that `completions` drops). `top_n`: the most likely tokens each step reports (0 or
        MAX_TOP_LOGPROBS: a few compilations); `score_prompt`: score the prompts' tokens too.

        Rows beyond len(prompts) (batch bucketing) are one-token dummies, done from the start.
        `images`: per prompt, its images [N, image_size, image_size, 3] (or None), whose features the
        prompt's image placeholders take (a vision-language model's prefill)."""
        self.check(prompts, budgets)
        b, p, room = self._shapes(prompts, budgets)
        features = None
        if images is not None and any(x is not None and len(x) for x in images):
            self.check_images(prompts, images)
            rows = [None if x is None or not len(x) else self.image_features(x) for x in images]
            width = next(r.shape[1] for r in rows if r is not None)
            features = np.zeros((b, length_bucket(max(len(r) for r in rows if r is not None)), width),
                                next(r.dtype for r in rows if r is not None))
            for i, r in enumerate(rows):
                if r is not None:
                    features[i, :len(r)] = r
        elif self.model.vision is not None:
            self.check_images(prompts, [None] * len(prompts))
        tokens = np.zeros((b, p), np.int32)
        pad = np.full((b,), p - 1, np.int32)
        budget = np.ones((b,), np.int32)
        temperature, top_p = np.zeros((b,), np.float32), np.ones((b,), np.float32)
        presence, frequency = np.zeros((b,), np.float32), np.zeros((b,), np.float32)
        top_k = np.zeros((b,), np.int32)
        keys = np.zeros((b, 2), np.uint32)
        for i, (ids, s, nb) in enumerate(zip(prompts, samplings, budgets)):
            tokens[i, p - len(ids):] = ids
            pad[i], budget[i] = p - len(ids), nb
            temperature[i], top_k[i], top_p[i] = s.temperature, s.top_k, s.top_p
            presence[i], frequency[i] = s.presence_penalty, s.frequency_penalty
            keys[i] = seed_key_data(s.seed)
        args = (self.params, self._put(tokens, ("batch", None)), *(self._put(x, ("batch",)) for x in
                (pad, budget, temperature, top_k, top_p)), self._put(keys, ("batch", None)),
                *(self._put(x, ("batch",)) for x in (presence, frequency)),
                None if features is None else self._put(features, ("batch", None, None)))
        static = dict(room=room, top_n=top_n, score_prompt=score_prompt)
        key = ("prefill", b, p, room, top_n, score_prompt, None if features is None else features.shape[1])
        return self._compile(key, self._prefill, *args, **static)(*args)

    def advance(self, state: DecodeState, stop: int | None = None) -> DecodeState:
        """Decodes until `stop` new tokens (default: the room) or every row is done; `state` is consumed."""
        stop = jnp.int32(state.tokens.shape[1] if stop is None else stop)
        key = ("advance", self._prompt_room(state), state.top_ids.shape, state.prompt_logprobs.shape)
        return self._compile(key, self._advance, self.params, state, stop)(self.params, state, stop)

    def read(self, state: DecodeState) -> tuple[np.ndarray, np.ndarray, int]:
        """(new tokens [B, S], done [B], count) on the host (every process gets all rows)."""
        tokens, done, count = self._gather((state.tokens, state.done, state.count))
        return np.asarray(tokens), np.asarray(done), int(count)

    def read_scores(self, state: DecodeState) -> dict[str, np.ndarray]:
        """The state's log-probability arrays (SCORE_FIELDS) on the host."""
        return {k: np.asarray(v) for k, v in zip(SCORE_FIELDS, self._gather(tuple(getattr(state, k)
                                                                                   for k in SCORE_FIELDS)))}

    def completions(self, prompts: Sequence[Sequence[int]], budgets: Sequence[int], tokens: np.ndarray,
                    count: int, scores: dict[str, np.ndarray] | None = None) -> list[Completion]:
        """Each row's new tokens, ended at end-of-document or its budget; with `scores` (read_scores),
        their log-probabilities and, when the prefill scored the prompts, the prompts'."""
        out = []
        for i, (ids, n) in enumerate(zip(prompts, budgets)):
            new = [int(x) for x in tokens[i, :min(n, count)]]
            if self.eod_id is not None and self.eod_id in new:
                c = Completion(list(ids), new[:new.index(self.eod_id) + 1], "stop")
            else:
                c = Completion(list(ids), new, "length")
            if scores is not None:
                c.scores = TokenScores.of(scores, i, slice(0, len(c.completion_ids)))
                p = scores["prompt_logprobs"].shape[1]
                if p:  # padded row: prompt token j of this row sits at p - len(ids) + j
                    c.prompt_scores = TokenScores.of(scores, i, slice(p - len(ids) + 1, p), "prompt_")
            out.append(c)
        return out

    def generate(self, prompts: Sequence[Sequence[int]], samplings: Sampling | Sequence[Sampling] = Sampling(),
                 max_new_tokens: int | Sequence[int] = 64, images: Sequence | None = None
                 ) -> tuple[list[Completion], Timing]:
        """Completions of `prompts` (one batch; `images` per prompt, as `start`) and the timing: time to
        first token (prefill and image encoding, compiled beforehand) and decode tokens/s."""
        samplings = [samplings] * len(prompts) if isinstance(samplings, Sampling) else list(samplings)
        budgets = [max_new_tokens] * len(prompts) if isinstance(max_new_tokens, int) else list(max_new_tokens)
        self.check(prompts, budgets)
        compiled_before = self.compile_s
        self._warm(prompts, samplings, budgets, images)
        t0 = time.perf_counter()
        state = self.start(prompts, samplings, budgets, images=images)
        jax.block_until_ready(state.tokens)
        t1 = time.perf_counter()
        state = self.advance(state)
        tokens, _, count = self.read(state)
        t2 = time.perf_counter()
        done = self.completions(prompts, budgets, tokens, count)
        decoded = sum(max(len(c.completion_ids) - 1, 0) for c in done)
        return done, Timing(compile_s=self.compile_s - compiled_before, time_to_first_token_s=t1 - t0,
                            decode_s=t2 - t1, decode_tokens=decoded, batch=len(prompts))

    def _shapes(self, prompts, budgets) -> tuple[int, int, int]:
        """(rows, padded prompt length P, new-token room S) a batch runs with."""
        return (batch_bucket(len(prompts), self.data_parallel), length_bucket(max(len(x) for x in prompts)),
                length_bucket(max(*budgets, 1)))

    def _warm(self, prompts, samplings, budgets, images=None) -> None:
        """Compiles the prefill and decode programs for this batch's shapes (when not yet cached)."""
        if ("prefill", *self._shapes(prompts, budgets)) in self._compiled:
            return
        state = self.start(prompts, samplings, budgets, images=images)
        self.advance(state, 1)
