"""Continuous batching over a paged KV cache: sequences join the running batch at the next step and
leave when they end.

    Engine(generator, max_batch, block_size, num_blocks, prefill_chunk, prefill_rows, prefill_shapes)
      .submit(jobs)   queued; admitted into a free row when the pool holds blocks for the whole sequence
      .ready          its programs compiled (the engine's thread compiles them at start)
      .stats()        running, waiting, kv_blocks_used, kv_blocks_total, kv_blocks_cached, prefix_cache_queries,
                    prefix_cache_hits, prefill_tokens

The KV cache is, per layer, a k and a v pool `[num_blocks * block_size, kv_heads, head_dim]`
(kv_heads over `tensor`; replicated over the data axes, so every data shard can read any block), or
a multi-latent attention layer's latent and rope-key pools `[num_blocks * block_size, features]`
(Transformer's `layer_caches`; megajax/models/mla.py). A hybrid model's Mamba layers keep one
state per batch row instead (`MambaSlots`, megajax/models/mamba.py: conv windows and SSM state
`[rows, ...]`, replicated over the data axes; its k entry, no v), which a prefill chunk reads and
writes through its sequences' rows, zeroed when a new sequence starts in the row (its chunk at
position 0); its MLP and MoE layers keep nothing. A
host-side `BlockPool` hands out blocks from a free list; each running sequence has a block table,
and its position p lives at pool slot `table[p // block_size] * block_size + p % block_size`.
A sequence is admitted only when the pool can hold its prompt plus its whole token budget, so a
running sequence never runs out of blocks (a full pool makes new requests wait; nothing is
preempted); its blocks go back to the pool the moment it ends, is stopped or is cancelled.

Each iteration of the engine's thread admits waiting jobs into free rows, runs one prefill chunk
(`prefill_chunk` tokens of up to `prefill_rows` prompts, default 4 per data shard: a long prompt
does not stall the running decodes, and many arriving prompts start within a few iterations; or, when
that prefills more prompt tokens, half (a quarter, an eighth of) the chunk of twice (4x, 8x) the
prompts, up to the rows: the same token count, so the same matrix products and the same numbers for
every position, and short pieces such as the rest of a prompt after a cached prefix share a call), then
`decode_steps` decode steps for every decoding row in one program call (one host round trip per
few tokens; a row stops at its end-of-document or budget on the device), hands out the new tokens
(streaming jobs get a piece per step), checks stop callbacks (tokens past a stop are dropped), and
frees finished rows. The programs have fixed shapes (max_batch rows, the prefill shapes,
context / block_size table entries) and are compiled once, before `ready`: a new prompt length
never compiles while clients wait.

Attention reads only the blocks in use: an online softmax over the table's first entries,
`attention_blocks` blocks per loop trip, for as many trips as the longest row of the call needs
(a traced count: no recompiles); see megajax/models/attention.py's paged_attention. A trip over
blocks a row cannot see leaves its numbers exactly unchanged (masked scores are -inf), so rows
never mix (every product and the attention are per row), and a sequence's tokens do not depend on
what else runs: greedy output under any interleaving equals the sequential output, bit for bit.
Per-row positions, step counts (sampling keys fold in the sequence's own step) and penalties make
sampled output independent of the interleaving too. (`attention_blocks=None` gathers every row's
whole table instead, as a [rows, kv_heads, context, head_dim] view: about half the tokens/s on
this CPU, scripts/bench_batching.py --attention-blocks 0.)

A vision-language model's request brings its images: the engine computes their projected features
when it admits the request (one image per encoder call, a program compiled with the other two), and
each prefill chunk takes the features of the image placeholders it holds, in order (an image may
straddle chunks); the pools then hold the image, and decode steps are text alone.

Prefix caching (`prefix_caching`, on by default): once a sequence's prefill has written a whole
prompt block, the block is kept under the hash chain of its token prefix (`prefix_hashes`); a new
sequence maps the cached blocks of its prompt's longest cached prefix (the last prompt token is
always computed) and prefills from there, and one whose next block a running sequence is writing
waits for it. Blocks are reference-counted; an unreferenced cached block counts as free and is
taken back, least recently used first, when the free list is empty (`BlockPool`). A sequence that
scores its prompt reuses the cached blocks' scores and recomputes the prefix's last position without
rewriting its k/v. Not for requests with images, nor for models with Mamba layers (a row's state
after a prefix is not per block), nor for the blocks of generated tokens (the decode steps wrote
their k/v, which differ from a prefill's of the same tokens in the last bits). Outputs equal those
without caching, bit for bit.

Events and Completions are the static Batcher's (megajax/inference/batcher.py), so the HTTP
layers do not know which batcher runs; the observer (megajax/inference/observer.py) hears the same
calls.
"""

from __future__ import annotations

import collections
import hashlib
import math
import os
import queue
import sys
import threading
import time
import traceback
from dataclasses import dataclass, field

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from megajax.errors import UserError
from megajax.inference.batcher import Job, Piece
from megajax.inference.generate import MAX_TOP_LOGPROBS, Completion, Generator, TokenScores
from megajax.inference.observer import Observer
from megajax.inference.sampling import apply_penalties, next_tokens, seed_key_data
from megajax.mesh import activation_sharding, logical_to_spec
from megajax.models.attention import PagedCache
from megajax.models.mamba import MambaSlots, MambaState

DEFAULT_BLOCK_SIZE = 16
DEFAULT_PREFILL_CHUNK = 128
DEFAULT_PREFILL_ROWS_PER_SHARD = 4  # prompts per prefill call and data shard (--prefill-rows default)
PREFILL_SHAPES = 4  # prefill programs at most: the chunk, its half, quarter and eighth (with 2, 4, 8 x the rows)


class BlockPool:
    """The KV pool's blocks on the host: a free list and each block's reference count (the sequences
    whose table holds it); with prefix caching, the full prompt blocks kept by their prefix hash.

    A cached block (`cache`) is found by the hash of its whole token prefix (`prefix_hashes`) and may be
    in several tables at once; when its last sequence releases it, it stays cached, unreferenced, in a
    least-recently-used line, and `allocate` takes it back (forgetting its hash) only when the free list
    is empty. `free` counts both: blocks a new sequence can have."""

    def __init__(self, num_blocks: int, block_size: int):
        self.num_blocks, self.block_size = num_blocks, block_size
        self._free = collections.deque(range(num_blocks))
        self.refs = [0] * num_blocks
        self._by_hash: dict[bytes, int] = {}
        self._hash_of: dict[int, bytes] = {}
        self._scores: dict[int, tuple] = {}  # block -> (log p of its tokens, their top alternatives or None)
        self._idle: collections.OrderedDict[int, None] = collections.OrderedDict()  # cached, unreferenced; LRU first
        self.evicted = 0  # cached blocks taken back for new sequences so far

    @property
    def free(self) -> int:
        return len(self._free) + len(self._idle)

    @property
    def cached(self) -> int:
        """Blocks that hold a cached prefix (referenced or not)."""
        return len(self._by_hash)

    def blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.block_size)

    def allocate(self, count: int) -> list[int] | None:
        """`count` fresh blocks (each referenced once), or None when fewer are free; the free list first,
        then the least recently used cached blocks, which leave the cache."""
        if count > self.free:
            return None
        blocks = []
        for _ in range(count):
            if self._free:
                b = self._free.popleft()
            else:
                b, _ = self._idle.popitem(last=False)
                del self._by_hash[self._hash_of.pop(b)]
                self._scores.pop(b, None)
                self.evicted += 1
            self.refs[b] = 1
            blocks.append(b)
        return blocks

    def take(self, blocks: list[int]) -> None:
        """One more reference to each of these cached blocks (a new sequence's prefix)."""
        for b in blocks:
            if self.refs[b] == 0:
                del self._idle[b]
            self.refs[b] += 1

    def release(self, blocks: list[int]) -> None:
        """One reference fewer to each block: an unreferenced cached block waits in the LRU line, another
        goes back to the free list."""
        for b in blocks:
            if self.refs[b] < 1:
                raise RuntimeError(f"KV block {b} released more often than taken")
            self.refs[b] -= 1
            if self.refs[b] == 0:
                if b in self._hash_of:
                    self._idle[b] = None
                else:
                    self._free.append(b)

    def lookup(self, hashes: list[bytes], scores: bool = False, top: bool = False) -> list[int]:
        """The cached blocks of the longest prefix of `hashes` (with their tokens' scores when `scores`, and
        their top alternatives when `top`); unreferenced: `take` them."""
        blocks = []
        for h in hashes:
            b = self._by_hash.get(h)
            if b is None or (scores and (b not in self._scores or (top and self._scores[b][1] is None))):
                break
            blocks.append(b)
        for b in blocks:  # most recently used now
            if b in self._idle:
                self._idle.move_to_end(b)
        return blocks

    def scores(self, block: int) -> tuple:
        return self._scores[block]

    def cache(self, block: int, h: bytes, scores: tuple | None) -> None:
        """Keeps a referenced, fully written block under its prefix hash `h` (a block with the same hash
        already cached keeps that one; this one stays private and is freed at the end). `scores`: the log
        p of the block's tokens (and top alternatives or None) when its sequence scored its prompt."""
        held = self._by_hash.get(h)
        if held is None and block not in self._hash_of:
            self._by_hash[h], self._hash_of[block] = block, h
            held = block
        if held is not None and scores is not None and (held not in self._scores or self._scores[held][1] is None):
            self._scores[held] = scores


def prefix_hashes(tokens: list[int], block_size: int) -> list[bytes]:
    """The hash chain of `tokens`' full blocks: block i's is sha256(block i-1's hash + block i's tokens),
    so equal hashes mean equal whole prefixes (the KV of a position depends on every token before it)."""
    out, h = [], b"megajax-kv"
    for i in range(len(tokens) // block_size):
        h = hashlib.sha256(h + np.asarray(tokens[i * block_size:(i + 1) * block_size], np.int64).tobytes()).digest()
        out.append(h)
    return out


@dataclass
class _Sequence:
    """A job in a row: its blocks, prefill progress and new tokens with their scores."""
    job: Job
    row: int
    blocks: list[int]
    prefilled: int = 0  # prompt tokens written to the cache
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top: list[list[tuple[int, float]]] = field(default_factory=list)
    prompt_logprobs: list[float] = field(default_factory=list)  # of prompt token j + 1, for j = 0, 1, ...
    prompt_top: list[list[tuple[int, float]]] = field(default_factory=list)
    last: float = 0.0  # when its previous tokens were handed out
    features: np.ndarray | None = None  # its images' features [placeholders, hidden] (a vision-language model)
    hashes: list[bytes] = field(default_factory=list)  # its prompt's full blocks' prefix hashes (prefix caching)
    cached: int = 0  # its leading blocks in the prefix cache (found there or put there once written)
    write_from: int = 0  # the first position its prefill writes (earlier ones are in shared blocks)

    @property
    def decoding(self) -> bool:
        return self.prefilled == len(self.job.prompt_ids)


def _top(ids, lps, wanted: bool) -> list[tuple[int, float]]:
    return [(int(t), float(v)) for t, v in zip(ids, lps)] if wanted else []


class Engine:
    """Runs every request's jobs on one Generator's model, `max_batch` sequences at a time, over a
    pool of `num_blocks` KV blocks of `block_size` positions (default: room for max_batch sequences
    of the full context)."""

    def __init__(self, generator: Generator, max_batch: int = 8, *, block_size: int = DEFAULT_BLOCK_SIZE,
                 num_blocks: int | None = None, prefill_chunk: int = DEFAULT_PREFILL_CHUNK,
                 prefill_rows: int | None = None, decode_steps: int = 8, attention_blocks: int | None = 4,
                 prefix_caching: bool = True, prefill_shapes: int = PREFILL_SHAPES, observer: Observer | None = None, quiet: bool = True):
        g = generator
        if not g.layer_buffers:
            raise ValueError("the continuous engine runs a Generator with per-layer buffers (layer_buffers=True)")
        check_engine_sizes(g.context, max_batch, block_size, num_blocks, prefill_chunk, prefill_rows)
        self.generator, self.max_batch, self.block_size = g, max_batch, block_size
        self.max_blocks = -(-g.context // block_size)  # table entries per sequence
        self.num_blocks = num_blocks if num_blocks is not None else max_batch * self.max_blocks
        check_pool_memory(g, self.num_blocks, block_size, max_batch, num_blocks is not None)
        self.chunk = min(prefill_chunk, g.context)
        self.decode_steps = decode_steps  # decode steps per engine iteration (one program call, one host sync)
        # KV blocks per trip of the attention over the blocks in use (None: every row gathers its whole table)
        self.attention_blocks = attention_blocks
        self.observer = observer or Observer()
        self.quiet = quiet
        dp = g.data_parallel
        self.rows = -(-max_batch // dp) * dp  # decode rows: max_batch, a multiple of the data-parallel size
        # prompts advanced by one chunk per iteration: a multiple of the data-parallel size, at most the rows
        wanted = prefill_rows if prefill_rows is not None else DEFAULT_PREFILL_ROWS_PER_SHARD * dp
        self.prefill_rows = min(-(-wanted // dp) * dp, self.rows)
        # the prefill program's shapes (rows, chunk): prefill_rows x chunk, and twice (4x, 8x) the rows of half
        # (a quarter, an eighth of) the chunk while they fit the rows: one program each, all of prefill_rows x
        # chunk tokens (the same matrix products: a position's numbers do not depend on the shape). Short
        # pieces (a prompt's tail, the rest after a cached prefix) of many prompts share one call.
        self.shapes = [(self.prefill_rows * 2 ** i, self.chunk // 2 ** i) for i in range(prefill_shapes)
                       if self.chunk % 2 ** i == 0 and self.prefill_rows * 2 ** i <= self.rows]
        self.pool = BlockPool(self.num_blocks, block_size)
        # Prefix caching: not for a model with Mamba layers (a row's state after a prefix is not kept per block)
        self.mamba = any(isinstance(jax.eval_shape(lambda layer=layer: layer.empty_pool("k", 1, 1, g.dtype)), MambaState)
                         for layer in g.layers)
        self.prefix_caching = prefix_caching and not self.mamba
        self.prefix_queries = self.prefix_hits = 0  # prompt tokens looked up in the prefix cache, and found there
        self.prefill_tokens = 0  # prompt tokens prefilled (computed) so far
        self.prefill_calls: collections.Counter = collections.Counter()  # prefill calls so far, by shape
        self.batches = 0  # engine iterations run so far
        self.sequences = 0  # sequences ended so far
        self.compile_s: float | None = None  # seconds its prefill and decode programs took to compile (None: not yet)
        self.ready = False
        self.error: str | None = None  # why the engine could not start
        self._queue: queue.Queue[Job | None] = queue.Queue()
        self._waiting: collections.deque[Job] = collections.deque()
        self._running: dict[int, _Sequence] = {}  # row -> sequence
        self._closing = False
        self._lock = threading.Lock()  # stats() reads what the engine's thread changes
        self._thread = threading.Thread(target=self._run, name="megajax-engine", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------ interface

    def submit(self, jobs: list[Job]) -> None:
        for job in jobs:
            self._queue.put(job)

    def close(self) -> None:
        """Finishes the jobs already submitted, then stops the engine's thread (while it compiles, after
        the compilation: a process that exits with XLA compiling in a thread aborts)."""
        self._queue.put(None)
        self._thread.join(timeout=60)

    def fits(self, prompt_tokens: int, max_new_tokens: int) -> bool:
        """Whether the pool can ever hold a sequence of this size."""
        return self.pool.blocks_for(prompt_tokens + max_new_tokens) <= self.num_blocks

    def stats(self) -> dict:
        """Sequences running and waiting; KV blocks held by sequences, in the pool, and holding a cached
        prefix; prompt tokens looked up in the prefix cache, found there, and prefilled (computed)."""
        with self._lock:
            return {"running": len(self._running), "waiting": len(self._waiting) + self._queue.qsize(),
                    "kv_blocks_used": self.num_blocks - self.pool.free, "kv_blocks_total": self.num_blocks,
                    "kv_blocks_cached": self.pool.cached, "prefix_cache_queries": self.prefix_queries,
                    "prefix_cache_hits": self.prefix_hits, "prefill_tokens": self.prefill_tokens}

    # ------------------------------------------------------------ traced

    def _caches(self, pools, write_BxL, table_BxM, used, rows_B, reset_B, valid_BxL):
        """Each layer's cache for this call: a PagedCache over an attention layer's pool, MambaSlots over
        a Mamba layer's row states, None for a layer without one."""
        def cache(pool, layer):
            if isinstance(pool, MambaState):
                return MambaSlots(pool, rows_B, reset_B, valid_BxL)
            if pool is None:
                return None
            if self.attention_blocks is None:
                return PagedCache(pool, write_BxL, table_BxM, self.block_size, axes=layer.pool_axes)
            return PagedCache(pool, write_BxL, table_BxM, self.block_size, used, self.attention_blocks, layer.pool_axes)
        return [cache(p, layer) for p, layer in zip(pools, self.generator.layers)]

    @staticmethod
    def _pools(caches) -> list:
        """The pools (or row states) of _caches' caches after a call."""
        return [c.pool_NxGxK if isinstance(c, PagedCache) else c.state if isinstance(c, MambaSlots) else None
                for c in caches]

    def _slots(self, table_BxM, positions):
        """Pool slots of `positions` [B, ...] through the rows' block tables [B, M]."""
        bs = self.block_size
        block = jnp.take_along_axis(table_BxM, (positions // bs).reshape(positions.shape[0], -1), axis=1)
        return block.reshape(positions.shape) * bs + positions % bs

    def _forward(self, params, pools_k, pools_v, tokens_BxL, start_B, valid_BxL, table_BxM, rows_B, all_positions,
                 image_features=None, write_from_B=None):
        """The model over L new tokens per row at positions start..start+L-1, writing the valid ones to
        the pools (a Mamba layer: to the state of the sequence's row `rows_B`, started afresh at
        position 0), those at `write_from_B` or later when given: (logits, pools_k, pools_v). `image_features` [B, L, D]: the features the rows' image
        placeholders among these tokens take, in order (a vision-language model's prefill)."""
        g = self.generator
        model, layers = g._model(params)
        b, l = tokens_BxL.shape
        t = self.max_blocks * self.block_size
        positions = jnp.minimum(start_B[:, None] + jnp.arange(l), g.context - 1)  # padding past the end: clamped
        drop = self.num_blocks * self.block_size  # outside the pool: the write is dropped
        written = valid_BxL if write_from_B is None else valid_BxL & (positions >= write_from_B[:, None])
        write = jnp.where(written, self._slots(table_BxM, positions), drop)
        used = (jnp.max(start_B) + l + self.block_size - 1) // self.block_size  # table entries any row reads
        caches = [self._caches(pools, write, table_BxM, used, rows_B, start_B == 0, valid_BxL)
                  for pools in (pools_k, pools_v)]
        logits, caches_k, caches_v = model.extend(
            tokens_BxL, positions, *caches, start=start_B, key_mask_BxT=jnp.ones((b, t), bool), layer_params=layers,
            expert_bias=g._expert_bias(), all_positions=all_positions, image_features=image_features)
        return logits, self._pools(caches_k), self._pools(caches_v)

    @staticmethod
    def _scores(logits, tokens, want_top):
        """(log p of `tokens`, top ids, top log p) with MAX_TOP_LOGPROBS alternatives when `want_top`
        (zeros otherwise: the top-k runs only when some row asks)."""
        logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
        chosen = jnp.take_along_axis(logp, tokens[..., None].astype(jnp.int32), axis=-1)[..., 0]
        shape = logp.shape[:-1] + (MAX_TOP_LOGPROBS,)

        def top():
            lp, ids = jax.lax.top_k(logp, MAX_TOP_LOGPROBS)
            return ids.astype(jnp.int32), lp

        ids, lp = jax.lax.cond(want_top, top, lambda: (jnp.zeros(shape, jnp.int32), jnp.zeros(shape, jnp.float32)))
        return chosen, ids, lp

    def _prefill_fn(self, params, pools_k, pools_v, tokens_RxC, start_R, length_R, write_from_R, targets_RxC,
                    table_RxM, rows_R, temperature_R, top_k_R, top_p_R, keys_Rx2, want_top, want_prompt,
                    features_RxCxD=None):
        """One chunk of up to R prompts: their k/v written (positions from `write_from`: a row may
        recompute the last position of its cached prefix for its score, not rewrite the shared block), the
        scores of the next prompt tokens (`targets`, when `want_prompt`), and the first new token of each
        row (used for a row whose prompt ends in this chunk). A vision-language model's `features_RxCxD`: the image features of
        the chunk's placeholders, in order (the cache then holds the images)."""
        with activation_sharding(self.generator.mesh, self.generator.rules):
            valid = jnp.arange(tokens_RxC.shape[1])[None, :] < length_R[:, None]
            logits, pools_k, pools_v = self._forward(params, pools_k, pools_v, tokens_RxC, start_R, valid,
                                                     table_RxM, rows_R, all_positions=True,
                                                     image_features=features_RxCxD,
                                                     write_from_B=write_from_R)  # [R, C, V]
            last = jnp.take_along_axis(logits, jnp.maximum(length_R - 1, 0)[:, None, None], axis=1)[:, 0]
            first = next_tokens(last, keys_Rx2, jnp.int32(0), temperature_R, top_k_R, top_p_R)
            shape, top = tokens_RxC.shape, tokens_RxC.shape + (MAX_TOP_LOGPROBS,)
            prompt = jax.lax.cond(want_prompt, lambda: self._scores(logits, targets_RxC, want_top),
                                  lambda: (jnp.zeros(shape, jnp.float32), jnp.zeros(top, jnp.int32),
                                           jnp.zeros(top, jnp.float32)))
            return pools_k, pools_v, (first, *self._scores(last, first, want_top), *prompt)

    def _decode_fn(self, params, pools_k, pools_v, last_B, position_B, active_B, table_BxM, rows_B, generated_BxS,
                   count_B, budget_B, temperature_B, top_k_B, top_p_B, keys_Bx2, presence_B, frequency_B, want_top):
        """Up to `decode_steps` decode steps of every row (fewer when every row is done): each writes
        the input token `last` at `position` (rows not done) and samples the next one at the row's own
        step `count` after its penalties; a row is done at end-of-document or its budget. Returns the
        pools and (tokens [B, S], their log p, top ids, top log p, new tokens per row [B])."""
        g, b, steps, n = self.generator, last_B.shape[0], self.decode_steps, MAX_TOP_LOGPROBS
        rows = jnp.arange(b)

        def step(c):
            i, pools_k, pools_v, last, position, done, generated, count, out = c
            logits, pools_k, pools_v = self._forward(params, pools_k, pools_v, last[:, None], position,
                                                     ~done[:, None], table_BxM, rows_B, all_positions=False)
            penalised = apply_penalties(logits, generated, count, presence_B, frequency_B)
            tok = next_tokens(penalised, keys_Bx2, count, temperature_B, top_k_B, top_p_B)
            out = [o.at[:, i].set(x) for o, x in zip(out, (tok, *self._scores(logits, tok, want_top)))]
            generated = generated.at[rows, jnp.where(done, generated.shape[1], count)].set(tok, mode="drop")
            more = jnp.where(done, 0, 1)
            ended = done | (count + 1 >= budget_B) | g._is_eod(tok)
            return (i + 1, pools_k, pools_v, jnp.where(done, last, tok), position + more, ended, generated,
                    count + more, out)

        with activation_sharding(g.mesh, g.rules):
            out = [jnp.zeros((b, steps), jnp.int32), jnp.zeros((b, steps), jnp.float32),
                   jnp.zeros((b, steps, n), jnp.int32), jnp.zeros((b, steps, n), jnp.float32)]
            c = (jnp.int32(0), pools_k, pools_v, last_B, position_B, ~active_B, generated_BxS, count_B, out)
            c = jax.lax.while_loop(lambda c: (c[0] < steps) & ~jnp.all(c[5]), step, c)
            return c[1], c[2], (*c[8], c[7] - count_B)

    # ------------------------------------------------------------ host: programs

    def _rows(self, *arrays) -> list[jax.Array]:
        """Host arrays with a leading row dim, placed with the rows over the data axes (one transfer)."""
        g = self.generator
        if g.mesh is None:
            return jax.device_put(list(arrays))
        return jax.device_put(list(arrays), [NamedSharding(g.mesh, logical_to_spec(("batch",) + (None,) * (a.ndim - 1),
                                                                                 g.rules)) for a in arrays])

    def _start(self) -> None:
        """The pools, the prefill program of each shape and the decode program, compiled (on example inputs of the fixed shapes)."""
        g = self.generator
        t0 = time.perf_counter()
        slots = self.num_blocks * self.block_size
        # each layer's pools: a k and a v [slots, kv_heads, head_dim], or a multi-latent layer's
        # latent [slots, kv_lora_rank] and rope key [slots, qk_pos_emb_head_dim] (replicated over tensor);
        # a Mamba layer's states of the rows (as its k), nothing for an MLP or MoE layer
        def empty(layer, which):
            return layer.empty_pool(which, slots, self.rows, g.dtype)
        if g.mesh is not None:
            pool_sh = [[jax.tree.map(lambda a: NamedSharding(g.mesh, logical_to_spec(a, g.rules)),
                                     layer.pool_axes_of(which), is_leaf=lambda a: type(a) is tuple)
                        for layer in g.layers] for which in "kv"]
            pools = [[jax.jit(lambda layer=layer, which=which: empty(layer, which), out_shardings=sh)()
                      for layer, sh in zip(g.layers, shardings)] for which, shardings in zip("kv", pool_sh)]
            replicated = NamedSharding(g.mesh, P())
            out = (*pool_sh, replicated)
        else:
            pools = [[empty(layer, which) for layer in g.layers] for which in "kv"]
            out = None
        self._pools_k, self._pools_v = pools
        prefill = jax.jit(self._prefill_fn, donate_argnums=(1, 2), out_shardings=out)
        decode = jax.jit(self._decode_fn, donate_argnums=(1, 2), out_shardings=out)
        self._prefill = {shape: prefill.lower(g.params, self._pools_k, self._pools_v,
                                              *self._prefill_inputs([], shape)).compile() for shape in self.shapes}
        self._decode = decode.lower(g.params, self._pools_k, self._pools_v, *self._decode_inputs([])).compile()
        v = g.model.vision
        if v is not None:  # the encoder's program for one image (a request's images go one at a time)
            g.image_features(np.zeros((1, v.image_size, v.image_size, 3), np.float32))
        self.compile_s = time.perf_counter() - t0
        if not self.quiet:
            shapes = ", ".join(f"{r} x {c}" for r, c in self.shapes)
            print(f"megajax serve: continuous batching compiled its prefill-chunk programs ({shapes} tokens) and "
                  f"decode-step program ({self.rows} rows) in {self.compile_s:.1f} s; "
                  f"KV pool {self.num_blocks} blocks x {self.block_size} positions; {self._caching_text()}",
                  file=sys.stderr, flush=True)

    def _caching_text(self) -> str:
        if self.prefix_caching:
            return "prefix caching on (not for requests with images)"
        if self.mamba:
            return ("prefix caching off: the model has Mamba layers, whose per-row state after a prefix is not "
                    "kept per block")
        return "prefix caching off"

    def _table(self, seqs: list[_Sequence], rows: int) -> np.ndarray:
        table = np.zeros((rows, self.max_blocks), np.int32)
        for i, s in enumerate(seqs):
            table[i, :len(s.blocks)] = s.blocks
        return table

    def _row_ids(self, seqs: list[_Sequence], rows: int) -> np.ndarray:
        """Each call row's batch row (whose Mamba states it reads and writes); self.rows for padding."""
        ids = np.full((rows,), self.rows, np.int32)
        ids[:len(seqs)] = [s.row for s in seqs]
        return ids

    def _sampling(self, jobs: list[Job], rows: int) -> list[np.ndarray]:
        temperature, top_p = np.zeros((rows,), np.float32), np.ones((rows,), np.float32)
        top_k, keys = np.zeros((rows,), np.int32), np.zeros((rows, 2), np.uint32)
        presence, frequency = np.zeros((rows,), np.float32), np.zeros((rows,), np.float32)
        for i, job in enumerate(jobs):
            s = job.sampling
            temperature[i], top_k[i], top_p[i] = s.temperature, s.top_k, s.top_p
            presence[i], frequency[i] = s.presence_penalty, s.frequency_penalty
            keys[i] = seed_key_data(s.seed)
        return [temperature, top_k, top_p, keys, presence, frequency]

    def _prefill_shape(self, seqs: list[_Sequence]) -> tuple[int, int]:
        """The prefill shape (rows, chunk) that prefills the most prompt tokens of `seqs` (first come first
        served) in one call; the longer chunk of two that prefill as many."""
        def tokens(shape):
            r, c = shape
            return sum(min(c, len(s.job.prompt_ids) - s.prefilled) for s in seqs[:r])
        return max(self.shapes, key=tokens)

    def _prefill_inputs(self, seqs: list[_Sequence], shape: tuple[int, int]) -> tuple:
        r, c = shape
        tokens, targets = np.zeros((r, c), np.int32), np.zeros((r, c), np.int32)
        start, length, write_from = np.zeros((r,), np.int32), np.zeros((r,), np.int32), np.zeros((r,), np.int32)
        for i, s in enumerate(seqs):
            prompt, a = s.job.prompt_ids, s.prefilled
            piece = prompt[a:a + c]
            tokens[i, :len(piece)], start[i], length[i], write_from[i] = piece, a, len(piece), s.write_from
            nxt = prompt[a + 1:a + 1 + c]
            targets[i, :len(nxt)] = nxt
        temperature, top_k, top_p, keys, _, _ = self._sampling([s.job for s in seqs], r)
        want_top = any(s.job.top_logprobs for s in seqs)
        want_prompt = any(s.job.score_prompt for s in seqs)
        rows = [tokens, start, length, write_from, targets, self._table(seqs, r), self._row_ids(seqs, r), temperature,
                top_k, top_p, keys]
        v = self.generator.model.vision
        if v is not None:  # each row's features of this chunk's placeholders, in order
            features = np.zeros((r, c, self.generator.model.hidden_size), self.generator.dtype)
            for i, s in enumerate(seqs):
                if s.features is None:
                    continue
                prompt, a = s.job.prompt_ids, s.prefilled
                before = sum(1 for t in prompt[:a] if t == v.image_token_id)
                here = sum(1 for t in prompt[a:a + c] if t == v.image_token_id)
                features[i, :here] = s.features[before:before + here]
            rows.append(features)
        arrays = self._rows(*rows)
        extra = tuple(arrays[11:])
        return (*arrays[:11], jnp.bool_(want_top), jnp.bool_(want_prompt), *extra)

    def _decode_inputs(self, seqs: list[_Sequence]) -> tuple:
        b = self.rows
        last, position, count = np.zeros((b,), np.int32), np.zeros((b,), np.int32), np.zeros((b,), np.int32)
        active, budget = np.zeros((b,), bool), np.zeros((b,), np.int32)
        generated = np.zeros((b, self.generator.context), np.int32)
        for i, s in enumerate(seqs):
            last[i], position[i] = s.tokens[-1], len(s.job.prompt_ids) + len(s.tokens) - 1
            active[i], count[i], budget[i] = True, len(s.tokens), s.job.max_new_tokens
            generated[i, :len(s.tokens)] = s.tokens
        sampling = self._sampling([s.job for s in seqs], b)
        want_top = any(s.job.top_logprobs for s in seqs)
        return (*self._rows(last, position, active, self._table(seqs, b), self._row_ids(seqs, b), generated, count,
                            budget, *sampling), jnp.bool_(want_top))

    # ------------------------------------------------------------ host: the loop

    def _run(self) -> None:
        try:
            self._start()
            self.ready = True
        except Exception as e:  # the server answers liveness; every request fails with the reason
            if not isinstance(e, MemoryError) and not str(e).startswith("RESOURCE_EXHAUSTED"):
                traceback.print_exc()  # a fault of the engine's own; out of memory is said in one line
            self.error = f"{type(e).__name__}: {e}"
        while True:
            self._take()
            if self._closing and not self._running and not self._waiting:
                return
            if self.error is not None:
                for job in self._waiting:
                    job.events.put(("error", job.index, f"the engine did not start ({self.error})"))
                self._waiting.clear()
                continue
            try:
                self._step()
            except Exception as e:  # the server keeps serving; the running sequences fail
                traceback.print_exc()
                for s in list(self._running.values()):
                    s.job.events.put(("error", s.job.index, f"{type(e).__name__}: {e}"))
                    self._end(s, "error", event=False)

    def _take(self) -> None:
        """Moves submitted jobs to the waiting line (blocking while there is nothing to do)."""
        idle = not self._running and not self._waiting and not self._closing
        while True:
            try:
                job = self._queue.get(timeout=None) if idle else self._queue.get_nowait()
            except queue.Empty:
                return
            idle = False
            if job is None:
                self._closing = True
            else:
                with self._lock:
                    self._waiting.append(job)

    def _step(self) -> None:
        self._drop_cancelled()
        self._admit()
        prefilling = sorted((s for s in self._running.values() if not s.decoding), key=lambda s: s.job.submitted)
        if prefilling:
            shape = self._prefill_shape(prefilling)
            self._prefill_chunk(prefilling[:shape[0]], shape)
        decoding = [s for s in self._running.values() if s.decoding and s.tokens]
        if decoding:
            self._decode_step(decoding)
        self.batches += 1

    def _drop_cancelled(self) -> None:
        for job in [j for j in self._waiting if j.cancelled]:
            with self._lock:
                self._waiting.remove(job)
            self.observer.finished(job, "cancelled", 0)
        for s in [s for s in self._running.values() if s.job.cancelled]:
            self._end(s, "cancelled", event=False)

    def _admit(self) -> None:
        """Waiting jobs into free rows, first come first served, while the pool holds their blocks. With
        prefix caching a job maps the cached blocks of its prompt's longest cached prefix and prefills the
        rest; a job whose next block is being prefilled by a running sequence waits for it (jobs behind it
        may go first)."""
        held = 0  # waiting jobs passed over (their prefix is being written)
        while held < len(self._waiting) and len(self._running) < self.max_batch:
            job = self._waiting[held]
            size = len(job.prompt_ids) + job.max_new_tokens
            need = self.pool.blocks_for(size)
            wrong = None
            if not job.prompt_ids or size > self.generator.context:  # the service checks these first
                wrong = f"a prompt of {len(job.prompt_ids)} tokens plus {job.max_new_tokens} new ones does not " \
                        f"fit the context ({self.generator.context} tokens)"
            elif need > self.num_blocks:
                wrong = f"the sequence needs {need} KV blocks; the pool has {self.num_blocks} (--num-kv-blocks)"
            if wrong is not None:
                with self._lock:
                    del self._waiting[held]
                job.events.put(("error", job.index, wrong))
                self.observer.finished(job, "error", 0)
                continue
            caching = self.prefix_caching and job.images is None
            hashes = prefix_hashes(job.prompt_ids, self.block_size) if caching else []
            # at least the last prompt token is computed (its logits give the first new token)
            usable = hashes[:(len(job.prompt_ids) - 1) // self.block_size]
            with self._lock:
                found = self.pool.lookup(usable, scores=job.score_prompt, top=job.top_logprobs > 0)
            if len(found) < len(usable) and self._writing(usable[len(found)]):
                held += 1
                continue
            with self._lock:
                self.pool.take(found)
                blocks = self.pool.allocate(need - len(found))
                if blocks is None:
                    self.pool.release(found)
                    return  # the pool is full: wait for running sequences to free theirs
                del self._waiting[held]
                row = min(set(range(self.rows)) - set(self._running))
                self._running[row] = s = _Sequence(job, row, found + blocks, hashes=hashes, cached=len(found))
                if caching:
                    self.prefix_queries += len(job.prompt_ids)
                    self.prefix_hits += len(found) * self.block_size
            if found:
                s.prefilled = s.write_from = len(found) * self.block_size
                if job.score_prompt:  # the scores of the cached tokens; the prefix's last position is recomputed
                    for b in found:    # for the score of the first token after it (its k/v is not rewritten)
                        lps, top = self.pool.scores(b)
                        s.prompt_logprobs += lps
                        s.prompt_top += top if top is not None else [[] for _ in lps]
                    s.prefilled -= 1
            if job.images is not None:
                try:
                    self.generator.check_images([job.prompt_ids], [job.images])
                    s.features = np.concatenate([self.generator.image_features(x[None]) for x in job.images])
                except UserError as e:  # the service checks these first
                    self._end(s, "error", event=False)
                    job.events.put(("error", job.index, str(e)))
                    continue
            self.observer.admitted(job)

    def _writing(self, h: bytes) -> bool:
        """Whether a running sequence is prefilling the block of prefix hash `h` (it will be cached)."""
        return any(h in s.hashes[s.cached:] for s in self._running.values())

    def _cache_written(self, s: _Sequence) -> None:
        """Puts the sequence's prompt blocks that its prefill has filled into the prefix cache, with their
        tokens' scores when it scores its prompt (block i holds tokens i*bs..: the score of token t is
        prompt_logprobs[t - 1]; token 0 has none)."""
        bs, job = self.block_size, s.job
        while s.cached < len(s.hashes) and (s.cached + 1) * bs <= s.prefilled:
            i = s.cached
            scores = None
            if job.score_prompt:
                part = slice(max(i * bs - 1, 0), (i + 1) * bs - 1)
                scores = (s.prompt_logprobs[part], s.prompt_top[part] if job.top_logprobs > 0 else None)
            with self._lock:
                self.pool.cache(s.blocks[i], s.hashes[i], scores)
            s.cached += 1

    def _prefill_chunk(self, seqs: list[_Sequence], shape: tuple[int, int]) -> None:
        c = shape[1]
        self.prefill_calls[shape] += 1
        self._pools_k, self._pools_v, out = self._prefill[shape](self.generator.params, self._pools_k,
                                                                 self._pools_v, *self._prefill_inputs(seqs, shape))
        first, lp, top_ids, top_lp, p_lp, p_ids, p_top = jax.device_get(out)
        for i, s in enumerate(seqs):
            job, prompt = s.job, s.job.prompt_ids
            start, length = s.prefilled, min(c, len(prompt) - s.prefilled)
            if job.score_prompt:  # position j predicts prompt token j + 1
                for j in range(min(length, len(prompt) - 1 - start)):
                    s.prompt_logprobs.append(float(p_lp[i, j]))
                    s.prompt_top.append(_top(p_ids[i, j], p_top[i, j], job.top_logprobs > 0))
            s.prefilled += length
            self.prefill_tokens += length
            if self.prefix_caching:
                self._cache_written(s)
            if not s.decoding:
                continue
            if job.stream and job.score_prompt:
                job.events.put(("prompt", job.index, TokenScores(s.prompt_logprobs, s.prompt_top)))
            if job.max_new_tokens == 0:  # scored only
                self._end(s, "length")
                continue
            now = time.monotonic()
            self.observer.first_token(job, now - job.submitted)
            s.last = now
            self._add(s, int(first[i]), float(lp[i]), _top(top_ids[i], top_lp[i], job.top_logprobs > 0))

    def _decode_step(self, seqs: list[_Sequence]) -> None:
        self._pools_k, self._pools_v, out = self._decode(self.generator.params, self._pools_k, self._pools_v,
                                                         *self._decode_inputs(seqs))
        tok, lp, top_ids, top_lp, new = jax.device_get(out)
        now = time.monotonic()
        for i, s in enumerate(seqs):
            self.observer.tokens(s.job, int(new[i]), now - s.last)
            s.last = now
            for j in range(int(new[i])):
                if self._running.get(s.row) is not s:  # ended at a stop sequence: the rest is dropped
                    break
                self._add(s, int(tok[i, j]), float(lp[i, j]), _top(top_ids[i, j], top_lp[i, j], s.job.top_logprobs > 0))

    def _add(self, s: _Sequence, token: int, logprob: float, top: list) -> None:
        """A sequence's new token: streamed, then the checks that end it."""
        job, eod = s.job, self.generator.eod_id
        s.tokens.append(token)
        s.logprobs.append(logprob)
        s.top.append(top)
        if job.stream:
            job.events.put(("tokens", job.index, Piece([token], TokenScores([logprob], [top]))))
            job.sent += 1
        if eod is not None and token == eod:
            job.ended = True
            self._end(s, "stop")
        elif len(s.tokens) >= job.max_new_tokens:
            self._end(s, "length")
        elif job.stopped is not None and job.stopped([t for t in s.tokens if t != eod]):
            job.halted = True
            self._end(s, "length")

    def _end(self, s: _Sequence, reason: str, event: bool = True) -> None:
        """Frees the sequence's row and blocks; with `event`, its ("done", Completion)."""
        with self._lock:
            del self._running[s.row]
            self.pool.release(s.blocks)
        job = s.job
        if event:
            c = Completion(list(job.prompt_ids), list(s.tokens), "stop" if reason == "stop" else "length",
                           scores=TokenScores(s.logprobs, s.top))
            if job.score_prompt:
                c.prompt_scores = TokenScores(s.prompt_logprobs, s.prompt_top)
            job.events.put(("done", job.index, c))
        self.sequences += 1
        self.observer.finished(job, reason, len(s.tokens))


def pool_bytes_per_device(g: Generator, slots: int, rows: int = 0) -> int:
    """Bytes of the KV pools (every attention layer's k and v, `slots` positions) and of the Mamba layers'
    states of `rows` rows (constant in the length) that one device holds."""
    total = 0
    for layer in g.layers:
        for which in "kv":
            pool = jax.eval_shape(lambda layer=layer, which=which: layer.empty_pool(which, slots, rows, g.dtype))
            axes = layer.pool_axes_of(which)
            for x, a in zip(jax.tree.leaves(pool), jax.tree.leaves(axes, is_leaf=lambda a: type(a) is tuple)):
                shape = x.shape
                if g.mesh is not None:
                    shape = NamedSharding(g.mesh, logical_to_spec(a, g.rules)).shard_shape(shape)
                total += math.prod(shape) * x.dtype.itemsize
    return total


def device_memory_bytes() -> int | None:
    """One local device's memory: the runtime's limit (GPU), else the host's memory shared by its simulated
    devices (CPU); None when unknown."""
    devices = jax.local_devices()
    stats = devices[0].memory_stats() or {}
    if stats.get("bytes_limit"):
        return int(stats["bytes_limit"])
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // len(devices)
    except (ValueError, OSError):
        return None


def check_pool_memory(g: Generator, num_blocks: int, block_size: int, max_batch: int, given: bool) -> None:
    """UserError naming --max-batch (or --num-kv-blocks when `given`) when the KV pool alone exceeds a device's
    memory: refused before it is allocated, instead of the engine failing in its thread."""
    rows = -(-max_batch // g.data_parallel) * g.data_parallel  # the engine's rows: each holds its Mamba states
    need, have = pool_bytes_per_device(g, num_blocks * block_size, rows), device_memory_bytes()
    if have is None or need <= have:
        return
    size = (f"--num-kv-blocks {num_blocks}" if given else
            f"--max-batch {max_batch} (a pool of {num_blocks} blocks: {max_batch} sequences of the whole "
            f"{g.context}-token context)")
    states = pool_bytes_per_device(g, 0, rows)  # a hybrid's Mamba states: fixed per row, whatever the length
    fits = max(1, (have - states) // max(1, pool_bytes_per_device(g, block_size)))
    raise UserError(f"{size}: the KV cache{' with the Mamba states' if states else ''} needs {need / 2**30:,.1f} GiB per device, more than the device's "
                    f"{have / 2**30:,.1f} GiB; at most {fits:,} blocks of {block_size} positions fit beside nothing "
                    f"else. Lower --max-batch, or set --num-kv-blocks to a pool that fits with the model.")


def check_engine_sizes(context: int, max_batch: int, block_size: int, num_blocks: int | None,
                       prefill_chunk: int, prefill_rows: int | None = None) -> None:
    """UserError naming the flag, its value and what is accepted."""
    if max_batch < 1:
        raise UserError(f"--max-batch {max_batch}: must be >= 1.")
    if not 1 <= block_size <= context:
        raise UserError(f"--block-size {block_size}: must be in [1, {context}] (the model's context).")
    if num_blocks is not None and num_blocks < 1:
        raise UserError(f"--num-kv-blocks {num_blocks}: must be >= 1 (default: room for --max-batch sequences "
                        f"of the whole context, {max_batch * -(-context // block_size)} blocks of {block_size}).")
    if num_blocks is not None and max_batch > num_blocks:  # the rows past the pool never run, yet cost memory
        raise UserError(f"--max-batch {max_batch} with --num-kv-blocks {num_blocks}: each running sequence holds a "
                        f"KV block of its own, so at most {num_blocks} run at once; set --max-batch {num_blocks} or "
                        f"less, or a larger pool.")
    if prefill_chunk < 1:
        raise UserError(f"--prefill-chunk {prefill_chunk}: must be >= 1 (tokens of a prompt prefilled per step).")
    if prefill_rows is not None and not 1 <= prefill_rows <= max_batch:
        raise UserError(f"--prefill-rows {prefill_rows}: must be in [1, {max_batch}] (--max-batch; prompts "
                        f"prefilled together per step, default {DEFAULT_PREFILL_ROWS_PER_SHARD} per data shard).")
