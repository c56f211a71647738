"""Decoder-only transformer: one family configured into GPT-2/Megatron-GPT or Llama 2/3.

    tokens [B, L] -> embed (+ learned positions) -> N x Block (scanned) -> norm -> logits [B, L, V]

Blocks are pre-norm: x + attn(norm(x)), then x + mlp(norm(x)). The N blocks'
parameters are stacked on a leading `layers` dim and applied with
`jax.lax.scan`, so compile time does not grow with depth.

A mixture-of-experts model with model.moe_layer_freq = F > 1 (layer i is MoE when i % F == 0)
holds two stacks: `layers`, its N / F MoE blocks, and `dense_layers`, the N - N / F dense ones,
in model order. It scans over the N / F groups of one MoE block followed by F - 1 dense blocks.

A hybrid model (model.hybrid_layer_pattern, Megatron's M * - E syntax) has one-mixer layers instead of
blocks (HybridLayer: a norm, then a Mamba-2 mixer, attention, an MLP or a mixture of experts, with its
residual). The pattern's shortest repeating run of layers (model.hybrid_group(): 'M*M-ME' repeated, or
the whole pattern) is one HybridGroup, and `layers` stacks the groups: the scan, the pipeline stages
and the layouts see groups where a transformer has blocks. In generation (`extend`) an attention layer
keeps its KV cache, a Mamba layer its MambaState (constant in the length) and an MLP or MoE layer
nothing (`layer_caches`).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, Callable

import jax
import jax.numpy as jnp
from flax import nnx

from megajax.config import ModelConfig
from megajax.mesh import logical_constraint
from megajax.models.attention import ACT_CACHE, ACT_POOL, Attention, make_attention_core
from megajax.models.layers import (Dense, Embed, LinearOps, dropout, make_norm, normal_init, padded_normal_init,
                                   rope_inv_freq)
from megajax.models.mamba import Mamba2Mixer, MambaState, empty_state, state_axes, state_numbers
from megajax.models.mla import LATENT_CACHE, LATENT_POOL, MultiLatentAttention
from megajax.models.mlp import MLP
from megajax.models.moe import MoE

RESIDUAL = ("batch", "residual_length", "embed")
LOGITS = ("batch", "length", "vocab")


class Block(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, dtype, attention_core: Callable, ops: LinearOps,
                 rngs: nnx.Rngs, expert_dispatch: Callable | None = None, moe: bool | None = None):
        """`moe`: a mixture-of-experts MLP (default: when cfg.num_experts > 0), else a dense one."""
        self.attn_norm = make_norm(cfg.norm, cfg.hidden_size, eps=cfg.norm_eps, dtype=dtype)
        if cfg.multi_latent_attention:
            self.attn = MultiLatentAttention(cfg, core=attention_core, dtype=dtype, ops=ops, rngs=rngs)
        else:
            self.attn = Attention(cfg, core=attention_core, dtype=dtype, ops=ops, rngs=rngs)
        self.mlp_norm = make_norm(cfg.norm, cfg.hidden_size, eps=cfg.norm_eps, dtype=dtype)
        if bool(cfg.num_experts) if moe is None else moe:
            self.mlp = MoE(cfg, dtype=dtype, dispatch=expert_dispatch, rngs=rngs, ops=ops)
        else:
            self.mlp = MLP(cfg, dtype=dtype, ops=ops, rngs=rngs)
        self.hidden_dropout = cfg.hidden_dropout

    def __call__(self, x_BxLxD, *, positions_BxL, segment_ids_BxL, inv_freq, dropout_rng, expert_bias_E=None):
        """(x [B, L, D], the MoE layer's RouterStats or None for a dense MLP); `expert_bias_E`: this
        layer's router expert bias [E] or None."""
        rngs = jax.random.split(dropout_rng, 3) if dropout_rng is not None else [None] * 3
        h = self.attn(self.attn_norm(x_BxLxD), positions_BxL=positions_BxL,
                      segment_ids_BxL=segment_ids_BxL, inv_freq=inv_freq, dropout_rng=rngs[0])
        x = logical_constraint(x_BxLxD + dropout(h, self.hidden_dropout, rngs[1], RESIDUAL), RESIDUAL)
        if isinstance(self.mlp, MoE):
            h, stats = self.mlp.forward(self.mlp_norm(x), expert_bias_E)
        else:
            mlp_rng = None if rngs[2] is None else jax.random.fold_in(rngs[2], 1)  # its adapters' dropout
            h, stats = self.mlp(self.mlp_norm(x), dropout_rng=mlp_rng), None
        return logical_constraint(x + dropout(h, self.hidden_dropout, rngs[2], RESIDUAL), RESIDUAL), stats

    def extend(self, x_BxLxD, *, positions_BxL, inv_freq, cache_k, cache_v, start, mask_BxLxT, segment_ids_BxL,
               expert_bias_E=None):
        """__call__ for L new tokens with this layer's KV cache (generation: no dropout); returns
        (x, cache_k, cache_v)."""
        h, cache_k, cache_v = self.attn.extend(
            self.attn_norm(x_BxLxD), positions_BxL=positions_BxL, inv_freq=inv_freq, cache_k_BxGxTxK=cache_k,
            cache_v_BxGxTxK=cache_v, start=start, mask_BxLxT=mask_BxLxT, segment_ids_BxL=segment_ids_BxL)
        x = logical_constraint(x_BxLxD + h, RESIDUAL)
        mlp_kwargs = {} if expert_bias_E is None else {"expert_bias_E": expert_bias_E}
        return logical_constraint(x + self.mlp(self.mlp_norm(x), fused=False, **mlp_kwargs), RESIDUAL), cache_k, cache_v


class MTPLayer(nnx.Module):
    """One multi-token prediction depth (Megatron-Core's MTP): the previous depth's hidden state and
    the embedding of the token one place further ahead, each normalised, concatenated and projected
    back to the hidden size, then one transformer block (a mixture of experts when
    cfg.mtp_moe(): like the last decoder layer by default) and its own final norm; the model's
    output layer gives the logits."""

    def __init__(self, cfg: ModelConfig, *, dtype, attention_core: Callable, ops: LinearOps, rngs: nnx.Rngs,
                 expert_dispatch: Callable | None = None):
        h = cfg.hidden_size
        self.embed_norm = make_norm(cfg.norm, h, eps=cfg.norm_eps, dtype=dtype)
        self.hidden_norm = make_norm(cfg.norm, h, eps=cfg.norm_eps, dtype=dtype)
        self.proj = Dense(2 * h, h, axes=(None, "embed"), init_std=cfg.init_std, dtype=dtype,
                          dot_general=ops.linear("duplicated", "mtp_projection"), rngs=rngs)
        self.block = Block(cfg, dtype=dtype, attention_core=attention_core, ops=ops, rngs=rngs,
                           expert_dispatch=expert_dispatch, moe=cfg.mtp_moe())
        self.final_norm = make_norm(cfg.norm, h, eps=cfg.norm_eps, dtype=dtype)


HYBRID_KINDS = {"M": "mamba", "*": "attention", "-": "mlp", "E": "moe"}


class HybridLayer(nnx.Module):
    """One layer of a hybrid model: x + mixer(norm(x)), the mixer one of a Mamba-2 mixer (M),
    attention (*), an MLP (-) or a mixture of experts (E) (Megatron-Core's hybrid layers)."""

    def __init__(self, cfg: ModelConfig, kind: str, *, dtype, attention_core: Callable, ops: LinearOps,
                 rngs: nnx.Rngs, expert_dispatch: Callable | None = None, sequence_mixer: Callable | None = None,
                 ssd: Callable | None = None, recompute: str = "none"):
        self.kind = HYBRID_KINDS[kind]
        self.norm = make_norm(cfg.norm, cfg.hidden_size, eps=cfg.norm_eps, dtype=dtype)
        if kind == "M":
            self.mixer = Mamba2Mixer(cfg, dtype=dtype, ops=ops, rngs=rngs, sequence_mixer=sequence_mixer, ssd=ssd,
                                     recompute=recompute)
        elif kind == "*":
            self.mixer = Attention(cfg, core=attention_core, dtype=dtype, ops=ops, rngs=rngs)
        elif kind == "-":
            self.mixer = MLP(cfg, dtype=dtype, ops=ops, rngs=rngs)
        else:
            self.mixer = MoE(cfg, dtype=dtype, dispatch=expert_dispatch, rngs=rngs, ops=ops)
        self.hidden_dropout = cfg.hidden_dropout

    def __call__(self, x_BxLxD, *, positions_BxL, segment_ids_BxL, inv_freq, dropout_rng, expert_bias_E=None):
        """(x [B, L, D], RouterStats of a MoE layer or None)."""
        rngs = jax.random.split(dropout_rng, 2) if dropout_rng is not None else [None] * 2
        h, stats = self.norm(x_BxLxD), None
        if self.kind == "attention":
            h = self.mixer(h, positions_BxL=positions_BxL, segment_ids_BxL=segment_ids_BxL, inv_freq=inv_freq,
                           dropout_rng=rngs[0])
        elif self.kind == "moe":
            h, stats = self.mixer.forward(h, expert_bias_E)
        elif self.kind == "mamba":
            h = self.mixer(h, segment_ids_BxL, dropout_rng=rngs[0])
        else:
            h = self.mixer(h, dropout_rng=rngs[0])
        return logical_constraint(x_BxLxD + dropout(h, self.hidden_dropout, rngs[1], RESIDUAL), RESIDUAL), stats

    def extend(self, x_BxLxD, *, positions_BxL, inv_freq, cache_k, cache_v, start, mask_BxLxT, segment_ids_BxL,
               valid_BxL, expert_bias_E=None):
        """__call__ for L new tokens with this layer's cache (generation): an attention layer's k and v
        (Attention.extend), a Mamba layer's state in `cache_k` (a MambaState or the engine's MambaSlots;
        `valid_BxL` its real tokens, cache_v None), nothing for an MLP or MoE layer. Returns (x, cache_k,
        cache_v)."""
        h = self.norm(x_BxLxD)
        if self.kind == "attention":
            h, cache_k, cache_v = self.mixer.extend(
                h, positions_BxL=positions_BxL, inv_freq=inv_freq, cache_k_BxGxTxK=cache_k, cache_v_BxGxTxK=cache_v,
                start=start, mask_BxLxT=mask_BxLxT, segment_ids_BxL=segment_ids_BxL)
        elif self.kind == "mamba":
            h, cache_k = self.mixer.extend(h, cache_k, valid_BxL=valid_BxL)
        elif self.kind == "moe":
            h = self.mixer(h, fused=False, expert_bias_E=expert_bias_E)
        else:
            h = self.mixer(h, fused=False)
        return logical_constraint(x_BxLxD + h, RESIDUAL), cache_k, cache_v


class HybridGroup(nnx.Module):
    """A run of hybrid layers (`pattern`, e.g. 'M*M-ME'), attributes layer0, layer1, ...: the unit a
    hybrid model stacks and scans, as a transformer stacks Blocks."""

    def __init__(self, cfg: ModelConfig, pattern: str, **kwargs):
        self.pattern = pattern
        for j, kind in enumerate(pattern):
            setattr(self, f"layer{j}", HybridLayer(cfg, kind, **kwargs))

    def __call__(self, x_BxLxD, *, positions_BxL, segment_ids_BxL, inv_freq, dropout_rng, expert_bias_E=None):
        """(x, the MoE layers' RouterStats stacked [MoE layers of the group] or None). `expert_bias_E`
        [the group's MoE layers, E] or None; layer j's dropout key is `dropout_rng` folded with j."""
        stats, e = [], 0
        for j, kind in enumerate(self.pattern):
            rng = None if dropout_rng is None else jax.random.fold_in(dropout_rng, j)
            bias = expert_bias_E[e] if kind == "E" and expert_bias_E is not None else None
            x_BxLxD, s = getattr(self, f"layer{j}")(x_BxLxD, positions_BxL=positions_BxL, segment_ids_BxL=segment_ids_BxL,
                                                     inv_freq=inv_freq, dropout_rng=rng, expert_bias_E=bias)
            if kind == "E":
                stats.append(s)
                e += 1
        return x_BxLxD, (jax.tree.map(lambda *xs: jnp.stack(xs), *stats) if stats else None)

    def extend(self, x_BxLxD, *, caches_k: list, caches_v: list, expert_bias_E=None, **kwargs):
        """HybridLayer.extend of each layer in turn, layer j with caches_k[j] and caches_v[j];
        `expert_bias_E` [the group's MoE layers, E] or None. Returns (x, caches_k, caches_v)."""
        new_k, new_v, e = [], [], 0
        for j, kind in enumerate(self.pattern):
            bias = expert_bias_E[e] if kind == "E" and expert_bias_E is not None else None
            e += kind == "E"
            x_BxLxD, k, v = getattr(self, f"layer{j}").extend(x_BxLxD, cache_k=caches_k[j], cache_v=caches_v[j],
                                                              expert_bias_E=bias, **kwargs)
            new_k.append(k)
            new_v.append(v)
        return x_BxLxD, new_k, new_v


def _add_layers_axis(module: nnx.Module, name: str = "layers") -> None:
    """Stacked parameters get a leading logical axis: `layers` (split over `pipeline` by its
    stages), or `stack` for the stacks every pipeline stage holds whole (a dense-first model's
    dense layers, run with the embedding on the first stage; the multi-token prediction depths,
    run with the loss on the last)."""
    for _, node in nnx.iter_graph(module):
        if isinstance(node, nnx.Variable):
            node.set_metadata(axes=(name,) + tuple(node.get_metadata()["axes"]))


class Transformer(nnx.Module):
    """Causal language model.

    `padded_vocab_size` is model.padded_vocab_size(); `ops` are the
    injected products (see LinearOps); `attention_core` the injected attention
    (default: model.attention_impl on one device); `expert_dispatch` the injected MoE token
    dispatch (default: all experts on this device, megajax/models/moe.py); `sequence_shift` the
    injected shift along the sequence of multi-token prediction (default shift_left; context
    parallelism's reordered sequences need their own); `sequence_mixer` the injected run of a Mamba
    mixer's conv and scan over the whole sequence (context parallelism's all-to-all; default: as is);
    `ssd` the Mamba mixers' scan (default: pallas_kernels/ssd.py's chunked jnp form);
    `recompute` is none | selective | full.
    """

    def __init__(self, cfg: ModelConfig, *, padded_vocab_size: int | None = None, dtype=jnp.float32,
                 recompute: str = "none", ops: LinearOps = LinearOps(), attention_core: Callable | None = None,
                 expert_dispatch: Callable | None = None, sequence_shift: Callable | None = None,
                 sequence_mixer: Callable | None = None, ssd: Callable | None = None, rngs: nnx.Rngs):
        self.cfg = cfg
        self.sequence_shift = sequence_shift or shift_left
        vocab = padded_vocab_size or cfg.padded_vocab_size()
        self.vocab_size, self.padded_vocab_size = cfg.vocab_size, vocab
        self.dtype = dtype
        self.embed = Embed(cfg.vocab_size, vocab, cfg.hidden_size, init_std=cfg.init_std,
                           dtype=dtype, ops=ops, tied=cfg.tie_embeddings, rngs=rngs)
        if cfg.position_embedding == "learned":
            self.pos_embed = nnx.Param(
                normal_init(rngs.params(), (cfg.max_position_embeddings, cfg.hidden_size), cfg.init_std),
                axes=("position", "embed"))
        core = attention_core or make_attention_core(cfg.attention_impl, recompute)

        def make_blocks(count: int, moe: bool, axis: str = "layers"):
            @nnx.split_rngs(splits=count)
            @nnx.vmap(in_axes=(0,), out_axes=0, axis_size=count)
            def make(rngs):
                if cfg.hybrid_layer_pattern:
                    return HybridGroup(cfg, cfg.hybrid_group(), dtype=dtype, attention_core=core, ops=ops, rngs=rngs,
                                       expert_dispatch=expert_dispatch, sequence_mixer=sequence_mixer, ssd=ssd,
                                       recompute=recompute)
                return Block(cfg, dtype=dtype, attention_core=core, ops=ops, rngs=rngs,
                             expert_dispatch=expert_dispatch, moe=moe)
            blocks = make(rngs)
            _add_layers_axis(blocks, axis)
            return blocks

        self.interleaved = cfg.interleaves_dense_layers()
        self.dense_first = cfg.dense_first_layers()
        self.hybrid = bool(cfg.hybrid_layer_pattern)
        if self.hybrid:  # the groups of the layer pattern
            self.layers = make_blocks(cfg.num_layers // len(cfg.hybrid_group()), False)
        elif self.dense_first:  # moe_layer_freq's list form: the dense layers, then the MoE ones
            self.dense_layers = make_blocks(self.dense_first, False, "stack")
            self.layers = make_blocks(cfg.num_layers - self.dense_first, True)
        elif self.interleaved:
            self.layers = make_blocks(cfg.num_moe_layers(), True)
            self.dense_layers = make_blocks(cfg.num_layers - cfg.num_moe_layers(), False)
        else:
            self.layers = make_blocks(cfg.num_layers, bool(cfg.num_experts))
        if cfg.mtp_num_layers:  # multi-token prediction depths, stacked like the layers
            @nnx.split_rngs(splits=cfg.mtp_num_layers)
            @nnx.vmap(in_axes=(0,), out_axes=0, axis_size=cfg.mtp_num_layers)
            def make_mtp(rngs):
                return MTPLayer(cfg, dtype=dtype, attention_core=core, ops=ops, rngs=rngs,
                                expert_dispatch=expert_dispatch)
            self.mtp = make_mtp(rngs)
            _add_layers_axis(self.mtp, "stack")
        self.recompute = recompute
        self.final_norm = make_norm(cfg.norm, cfg.hidden_size, eps=cfg.norm_eps, dtype=dtype)
        self.ops = ops
        self.output_product = ops.column if cfg.tie_embeddings else ops.linear("output", "output_layer")
        if not cfg.tie_embeddings:
            self.output = nnx.Param(
                padded_normal_init(rngs.params(), (cfg.hidden_size, vocab), cfg.init_std, 1, cfg.vocab_size),
                axes=("embed", "vocab"))
        if cfg.position_embedding == "rope":
            self.inv_freq = tuple(float(f) for f in rope_inv_freq(
                cfg.qk_pos_emb_head_dim if cfg.multi_latent_attention else cfg.head_dim, cfg.rope_theta, cfg.rope_scaling, cfg.rope_scaling_factor,
                cfg.rope_low_freq_factor, cfg.rope_high_freq_factor, cfg.rope_original_max_position,
                cfg.rope_beta_fast, cfg.rope_beta_slow))
        else:
            self.inv_freq = None

    def __call__(self, tokens_BxL: jax.Array, positions_BxL: jax.Array | None = None,
                 segment_ids_BxL: jax.Array | None = None,
                 dropout_rng: jax.Array | None = None, router_stats: bool = False,
                 expert_bias: jax.Array | None = None, mtp: bool = False, images: jax.Array | None = None):
        """Logits [B, L, padded vocab] in the compute dtype; padding columns hold the dtype's min.

        `images` [B, N, H, W, 3]: a vision-language model's images (megajax/models/vision.py), whose
        features replace the text's image placeholders.

        `router_stats`: returns (logits, RouterStats with a leading [layers] dim, or None for a
        dense model) for the train step's balancing losses. `expert_bias` [router layers, E] fp32:
        the routers' expert bias (TrainState.moe_expert_bias: the MoE layers', then a MoE multi-token
        prediction block's), None without one. `mtp`: returns (logits, router stats of the layers and
        then of the MTP depths, the MTP depths' logits [depths, B, L, padded vocab])."""
        b, l = tokens_BxL.shape
        if positions_BxL is None:
            positions_BxL = jnp.broadcast_to(jnp.arange(l, dtype=jnp.int32), (b, l))
        layers_bias, mtp_bias = self.split_expert_bias(expert_bias)
        rngs = jax.random.split(dropout_rng, 2) if dropout_rng is not None else [None, None]
        x = self.embed_input(tokens_BxL, positions_BxL, rngs[0],
                             **({} if images is None else {"images_BxNxHxWxC": images}))
        x, stats = self.layer_stack(x, positions_BxL=positions_BxL, segment_ids_BxL=segment_ids_BxL,
                                    dropout_rng=rngs[1], expert_bias=layers_bias)
        logits = self.logits(x)
        if mtp:
            hidden, mtp_stats = self.mtp_hidden(tokens_BxL, x, positions_BxL, segment_ids_BxL, mtp_bias)
            mtp_logits = jnp.stack([self._mask_padding(self.output_layer(h)) for h in hidden])
            return logits, join_router_stats(stats, mtp_stats), mtp_logits
        return (logits, stats) if router_stats else logits

    def split_expert_bias(self, expert_bias: jax.Array | None) -> tuple[jax.Array | None, jax.Array | None]:
        """(the MoE layers' rows, the MoE multi-token prediction depths' rows or None) of the routers'
        expert bias [router layers, E] (or None)."""
        if expert_bias is None:
            return None, None
        n = self.cfg.num_moe_layers()
        return expert_bias[:n], (expert_bias[n:] if self.cfg.mtp_moe() else None)

    def mtp_hidden(self, tokens_BxL, x_BxLxD, positions_BxL, segment_ids_BxL,
                   expert_bias_DxE: jax.Array | None = None) -> tuple[list[jax.Array], Any]:
        """Multi-token prediction: depth k (from 1) predicts the token k + 1 places ahead of each
        position, from depth k - 1's output after its final norm (for k = 1 the model's last hidden
        state after the model's final norm, as Megatron-Core feeds it) and the embedding of the tokens
        (and positions) shifted k places left, as Megatron-Core rolls them: the last k positions see
        token 0 at position 0 (the loss masks them). In a packed batch (`segment_ids_BxL`) the shift
        stays inside each document: the last k positions of every document see token 0 at position 0,
        as they would alone. `x_BxLxD` is the layer stack's output, before the
        final norm; `expert_bias_DxE` a MoE block's expert bias per depth. No dropout. Returns (each
        depth's output after its final norm [B, L, D], what the output layer takes; the depths'
        RouterStats stacked [depths] for a MoE block, else None)."""
        graphdef, state = nnx.split(self.mtp)
        inv_freq, h, tokens, positions = self.rope_inv_freq(), self.final_norm(x_BxLxD), tokens_BxL, positions_BxL
        out, stats = [], []
        shift = self.sequence_shift
        if segment_ids_BxL is not None:  # a shift within each document: zeros where the next token is another's
            same = shift(segment_ids_BxL, 1) == segment_ids_BxL
            shift = lambda x, k: jnp.where(same, self.sequence_shift(x, k), 0)
        for k in range(self.cfg.mtp_num_layers):
            layer = nnx.merge(graphdef, jax.tree.map(lambda a: a[k], state))
            tokens, positions = shift(tokens, 1), shift(positions, 1)
            emb = layer.embed_norm(self.embed_tokens(tokens, positions))
            h = layer.proj(jnp.concatenate([emb, layer.hidden_norm(h)], axis=-1))
            h, s = layer.block(logical_constraint(h, RESIDUAL), positions_BxL=positions_BxL,
                               segment_ids_BxL=segment_ids_BxL, inv_freq=inv_freq, dropout_rng=None,
                               expert_bias_E=None if expert_bias_DxE is None else expert_bias_DxE[k])
            h = layer.final_norm(h)  # what the output layer and the next depth take
            out.append(h)
            stats.append(s)
        return out, (None if stats[0] is None else jax.tree.map(lambda *xs: jnp.stack(xs), *stats))

    def embed_input(self, tokens_BxL: jax.Array, positions_BxL: jax.Array, dropout_rng: jax.Array | None):
        """The first layer's input [B, L, D]: embeddings with their dropout (`dropout_rng`: the first
        of __call__'s two dropout keys)."""
        x = dropout(self.embed_tokens(tokens_BxL, positions_BxL), self.cfg.hidden_dropout, dropout_rng, RESIDUAL)
        return logical_constraint(x, RESIDUAL)

    def layer_stack(self, x_BxLxD: jax.Array, *, positions_BxL: jax.Array, segment_ids_BxL: jax.Array | None,
                    dropout_rng: jax.Array | None, first_layer: int | jax.Array = 0,
                    expert_bias: jax.Array | None = None, dense_first: bool = True):
        """The blocks held in `self.layers` (all of them, or a pipeline stage's consecutive run of
        them starting at model layer `first_layer`), scanned: (x, router stats or None). Layer n's
        dropout key is `dropout_rng` (__call__'s second key) folded with n, so a stage draws the
        masks the whole model would. `expert_bias` [count, E]: these layers' router expert bias, or None.
        A dense-first model runs its dense layers first; with `dense_first=False` (a pipeline
        stage: the first stage runs them with the embedding, dense_first_stack) only `self.layers`,
        `first_layer` then counting them from 0."""
        if self.dense_first:
            if dense_first:
                x_BxLxD = self.dense_first_stack(x_BxLxD, positions_BxL=positions_BxL,
                                                 segment_ids_BxL=segment_ids_BxL, dropout_rng=dropout_rng)
            return self._scan(self.layers, x_BxLxD, positions_BxL=positions_BxL, segment_ids_BxL=segment_ids_BxL,
                              dropout_rng=dropout_rng, first_layer=first_layer + self.dense_first,
                              expert_bias=expert_bias)
        if self.interleaved:
            return self._grouped_stack(x_BxLxD, positions_BxL=positions_BxL, segment_ids_BxL=segment_ids_BxL,
                                       dropout_rng=dropout_rng, first_layer=first_layer, expert_bias=expert_bias)
        return self._scan(self.layers, x_BxLxD, positions_BxL=positions_BxL, segment_ids_BxL=segment_ids_BxL,
                          dropout_rng=dropout_rng, first_layer=first_layer, expert_bias=expert_bias)

    def dense_first_stack(self, x_BxLxD: jax.Array, *, positions_BxL: jax.Array,
                          segment_ids_BxL: jax.Array | None, dropout_rng: jax.Array | None) -> jax.Array:
        """A dense-first model's dense layers (model layers 0..k-1), scanned."""
        return self._scan(self.dense_layers, x_BxLxD, positions_BxL=positions_BxL, segment_ids_BxL=segment_ids_BxL,
                          dropout_rng=dropout_rng, first_layer=0, expert_bias=None)[0]

    def _scan(self, blocks, x_BxLxD, *, positions_BxL, segment_ids_BxL, dropout_rng, first_layer, expert_bias):
        """One stack of blocks, scanned from model layer `first_layer`: (x, router stats or None)."""
        inv_freq = self.rope_inv_freq()
        block_def, block_state = nnx.split(blocks)
        count = jax.tree.leaves(block_state)[0].shape[0]

        def body(x, layer):
            params, index, bias = layer
            block = nnx.merge(block_def, params)
            rng = None if dropout_rng is None else jax.random.fold_in(dropout_rng, index)
            return block(x, positions_BxL=positions_BxL, segment_ids_BxL=segment_ids_BxL,
                         inv_freq=inv_freq, dropout_rng=rng, expert_bias_E=bias)

        if self.recompute == "full":
            body = jax.checkpoint(body, prevent_cse=False)
        per_group = self.cfg.hybrid_group().count("E") if self.hybrid else 0
        if per_group and expert_bias is not None:  # a hybrid group's MoE layers: [groups, per group, E]
            expert_bias = expert_bias.reshape((count, per_group) + expert_bias.shape[1:])
        x, stats = jax.lax.scan(body, x_BxLxD, (block_state, first_layer + jnp.arange(count), expert_bias),
                                unroll=1 if self.cfg.scan_layers else True)
        if per_group and stats is not None:
            stats = jax.tree.map(lambda a: a.reshape((count * per_group,) + a.shape[2:]), stats)
        return x, stats

    def _grouped_stack(self, x_BxLxD, *, positions_BxL, segment_ids_BxL, dropout_rng, first_layer, expert_bias):
        """layer_stack of a model whose MoE layers alternate with dense ones (moe_layer_freq F > 1):
        a scan over the groups [MoE block, F - 1 dense blocks]; the stats of the MoE blocks."""
        inv_freq, f, unroll = self.rope_inv_freq(), self.cfg.moe_layer_freq, 1 if self.cfg.scan_layers else True
        moe_def, moe_state = nnx.split(self.layers)
        dense_def, dense_state = nnx.split(self.dense_layers)
        groups = jax.tree.leaves(moe_state)[0].shape[0]
        dense_state = jax.tree.map(lambda p: p.reshape((groups, f - 1) + p.shape[1:]), dense_state)

        def runner(graphdef):
            def run(params, x, index, bias):
                rng = None if dropout_rng is None else jax.random.fold_in(dropout_rng, index)
                return nnx.merge(graphdef, params)(x, positions_BxL=positions_BxL, segment_ids_BxL=segment_ids_BxL,
                                                   inv_freq=inv_freq, dropout_rng=rng, expert_bias_E=bias)
            return jax.checkpoint(run, prevent_cse=False) if self.recompute == "full" else run

        moe_block, dense_block = runner(moe_def), runner(dense_def)

        def group(x, xs):
            moe_params, dense_params, first, bias = xs  # first: the group's model layer (its MoE block's)
            x, stats = moe_block(moe_params, x, first, bias)

            def dense(x, layer):
                params, index = layer
                return dense_block(params, x, index, None)[0], None

            x, _ = jax.lax.scan(dense, x, (dense_params, first + 1 + jnp.arange(f - 1)), unroll=unroll)
            return x, stats

        return jax.lax.scan(group, x_BxLxD, (moe_state, dense_state, first_layer + f * jnp.arange(groups),
                                             expert_bias), unroll=unroll)

    def embed_tokens(self, tokens_BxL: jax.Array, positions_BxL: jax.Array) -> jax.Array:
        """Token embeddings (+ learned positions) [B, L, D] in the compute dtype."""
        x = self.embed(tokens_BxL)
        if self.cfg.position_embedding == "learned":
            x = x + self.ops.embed_positions(self.pos_embed[...], positions_BxL).astype(self.dtype)
        return x

    def rope_inv_freq(self) -> jax.Array | None:
        return None if self.inv_freq is None else jnp.asarray(self.inv_freq, jnp.float32)

    def output_logits(self, x_BxLxD: jax.Array) -> jax.Array:
        """Final norm and output layer: logits [B, L, padded vocab], the padding columns as computed."""
        return self.output_layer(self.final_norm(x_BxLxD))

    def output_layer(self, x: jax.Array) -> jax.Array:
        """The output layer alone (no final norm): logits [B, L, padded vocab], the padding columns as computed."""
        if self.cfg.tie_embeddings:
            logits = self.embed.attend(x)
        else:
            logits = self.output_product(x, self.output[...].astype(self.dtype), (((2,), (0,)), ((), ())))
        return logical_constraint(logits, LOGITS)

    def logits(self, x_BxLxD: jax.Array) -> jax.Array:
        """Final norm and output layer: logits [B, L, padded vocab]; padding columns hold the dtype's min."""
        return self._mask_padding(self.output_logits(x_BxLxD))

    def _mask_padding(self, logits: jax.Array) -> jax.Array:
        if self.padded_vocab_size != self.vocab_size:
            real = jnp.arange(self.padded_vocab_size) < self.vocab_size
            logits = jnp.where(real, logits, jnp.finfo(logits.dtype).min)
        return logits

    def extend(self, tokens_BxL: jax.Array, positions_BxL: jax.Array, cache_k, cache_v, *, start: int | jax.Array,
               key_mask_BxT: jax.Array, layer_params: list | None = None,
               expert_bias: jax.Array | None = None, all_positions: bool = False,
               image_features: jax.Array | None = None) -> tuple[jax.Array, Any, Any]:
        """Generation step: L new tokens occupying cache slots [start, start + L) of every sequence.

        The KV cache is, for k and for v, either one array [layers, B, kv_heads, T, head_dim]
        carried through the scanned layers, or, with `layer_params` (the blocks' parameters one
        layer at a time, used instead of the stacked `layers`), a list of per-layer
        [B, kv_heads, T, head_dim] arrays (see Generator: per-layer buffers are read in place on
        CPU). `key_mask_BxT` marks the slots holding this sequence's tokens (left padding is
        False), and a new token sees those up to its own slot. A prompt is prefilled in one call
        (L = its padded length, start the Python int 0: the injected attention core runs on the
        prompt alone), then each decode step is a call with L = 1 (plain jnp over the cache). Returns
        (logits [B, padded vocab] of the last new token, or [B, L, padded vocab] of every new token with
        `all_positions` (a prefill that scores its prompt), cache_k, cache_v); the same parameters and
        products as __call__ (`expert_bias` [router layers, E]: the routers' expert bias, or None). A
        multi-latent layer's cache_k and cache_v hold its latent and rope key ([B, T, features]:
        `layer_caches`). The MTP depths are not run: generation uses the main output head.

        Continuous batching passes `start` per row ([B]: each sequence at its own position) and, with
        `layer_params`, a PagedCache per layer (block pools read and written through block tables).

        A hybrid model's caches are per layer (`layer_caches`): an attention layer's k and v, a Mamba
        layer's MambaState (or the engine's MambaSlots) as cache_k with cache_v None, None for an MLP or
        MoE layer; `layer_params` then holds the groups' parameters one group at a time, and the stacked
        form is a list over the group's layers of caches stacked over the groups. In a prefill a Mamba
        layer skips the tokens `key_mask_BxT` marks as padding (the left padding of a batched prompt);
        a decode step's tokens are all real to it.

        A vision-language model's prefill passes `image_features` [B, M, D] (VisionLanguageModel's
        image_embeddings, or the part of them a prefill chunk's placeholders take): the k-th image
        placeholder of a row among these tokens takes the row's k-th feature; the cache then holds
        the images and decode steps are text alone."""
        b, l = tokens_BxL.shape
        expert_bias, _ = self.split_expert_bias(expert_bias)
        x = self.embed_tokens(tokens_BxL, positions_BxL)
        if image_features is not None:
            x = self.splice_image_features(x, tokens_BxL, image_features)
        x = logical_constraint(x, RESIDUAL)
        slots = jnp.asarray(start)[..., None] + jnp.arange(l)  # [L], or [B, L] for a per-row start
        causal = jnp.arange(key_mask_BxT.shape[1]) <= slots[..., None]  # [(B,) L, T]
        mask = key_mask_BxT[:, None, :] & causal
        prefill = isinstance(start, int) and start == 0
        segment_ids = key_mask_BxT[:, :l].astype(jnp.int32) if prefill else None
        inv_freq = self.rope_inv_freq()
        if self.hybrid:
            valid = key_mask_BxT[:, :l] if prefill else None  # the engine's MambaSlots carry their own
            x, cache_k, cache_v = self._hybrid_extend(
                x, cache_k, cache_v, layer_params, expert_bias, positions_BxL=positions_BxL, inv_freq=inv_freq,
                start=start, mask_BxLxT=mask, segment_ids_BxL=segment_ids, valid_BxL=valid)
            if all_positions:
                return self.logits(x), cache_k, cache_v
            return self.logits(x[:, -1:])[:, 0], cache_k, cache_v
        block_def, block_state = nnx.split(self.layers)
        unroll = 1 if self.cfg.scan_layers else True

        def runner(graphdef):
            def body(x, layer):
                params, k, v, bias = layer
                x, k, v = nnx.merge(graphdef, params).extend(
                    x, positions_BxL=positions_BxL, inv_freq=inv_freq, cache_k=k, cache_v=v, start=start,
                    mask_BxLxT=mask, segment_ids_BxL=segment_ids, expert_bias_E=bias)
                return x, (k, v)
            return body

        body = runner(block_def)
        if self.interleaved or self.dense_first:  # the dense blocks: in groups with a MoE one, or first
            f, first = self.cfg.moe_layer_freq, self.dense_first
            dense_def, dense_state = nnx.split(self.dense_layers)
            dense_body = runner(dense_def)
        if layer_params is not None:
            new_k, new_v = [], []
            for n, (params, k, v) in enumerate(zip(layer_params, cache_k, cache_v, strict=True)):
                if (self.interleaved and n % f) or n < self.dense_first:
                    x, (k, v) = dense_body(x, (params, k, v, None))
                else:
                    moe = n // f if self.interleaved else n - self.dense_first
                    x, (k, v) = body(x, (params, k, v, None if expert_bias is None else expert_bias[moe]))
                new_k.append(k)
                new_v.append(v)
            cache_k, cache_v = new_k, new_v
        elif self.dense_first:  # the dense layers' caches are the first `first` of the stacked ones
            x, (k0, v0) = jax.lax.scan(lambda x, layer: dense_body(x, layer + (None,)), x,
                                       (dense_state, cache_k[:first], cache_v[:first]), unroll=unroll)
            x, (k1, v1) = jax.lax.scan(body, x, (block_state, cache_k[first:], cache_v[first:], expert_bias),
                                       unroll=unroll)
            cache_k, cache_v = jnp.concatenate([k0, k1]), jnp.concatenate([v0, v1])
        elif not self.interleaved:
            x, (cache_k, cache_v) = jax.lax.scan(body, x, (block_state, cache_k, cache_v, expert_bias), unroll=unroll)
        else:
            groups = jax.tree.leaves(block_state)[0].shape[0]
            per_group = functools.partial(jax.tree.map, lambda p: p.reshape((groups, -1) + p.shape[1:]))

            def group(x, xs):
                params, dense_params, k, v, bias = xs  # k, v: [F, ...], the group's layers' caches
                x, (k0, v0) = body(x, (params, k[0], v[0], bias))
                x, (k1, v1) = jax.lax.scan(lambda x, layer: dense_body(x, layer + (None,)), x,
                                           (dense_params, k[1:], v[1:]), unroll=unroll)
                return x, (jnp.concatenate([k0[None], k1]), jnp.concatenate([v0[None], v1]))

            x, (cache_k, cache_v) = jax.lax.scan(
                group, x, (block_state, per_group(dense_state), per_group(cache_k), per_group(cache_v), expert_bias),
                unroll=unroll)
            cache_k, cache_v = (c.reshape((-1,) + c.shape[2:]) for c in (cache_k, cache_v))
        if all_positions:
            return self.logits(x), cache_k, cache_v
        return self.logits(x[:, -1:])[:, 0], cache_k, cache_v


    def _hybrid_extend(self, x_BxLxD, cache_k, cache_v, layer_params, expert_bias, **kwargs):
        """extend's layers for a hybrid model: group by group with per-layer caches and per-group
        parameters (`layer_params`), or scanned over the stacked groups with per-slot stacked caches."""
        group = self.cfg.hybrid_group()
        n, moe = len(group), group.count("E")
        block_def, block_state = nnx.split(self.layers)
        groups = self.cfg.num_layers // n
        if expert_bias is not None:  # [MoE layers, E] -> [groups, the group's MoE layers, E]
            expert_bias = expert_bias.reshape((groups, moe) + expert_bias.shape[1:])

        def body(x, xs):
            params, ks, vs, bias = xs
            x, ks, vs = nnx.merge(block_def, params).extend(x, caches_k=ks, caches_v=vs, expert_bias_E=bias, **kwargs)
            return x, (ks, vs)

        if layer_params is None:
            x_BxLxD, (cache_k, cache_v) = jax.lax.scan(body, x_BxLxD, (block_state, cache_k, cache_v, expert_bias),
                                                       unroll=1 if self.cfg.scan_layers else True)
            return x_BxLxD, cache_k, cache_v
        new_k, new_v = [], []
        for i, params in enumerate(layer_params):
            part = slice(i * n, (i + 1) * n)
            x_BxLxD, (ks, vs) = body(x_BxLxD, (params, cache_k[part], cache_v[part],
                                               None if expert_bias is None else expert_bias[i]))
            new_k += ks
            new_v += vs
        return x_BxLxD, new_k, new_v


def shift_left(x_BxL: jax.Array, k: int) -> jax.Array:
    """x[:, i + k] at position i, zeros in the last k positions (Megatron-Core's roll_tensor for
    multi-token prediction), on a sequence in its natural order."""
    return jnp.concatenate([x_BxL[:, k:], jnp.zeros_like(x_BxL[:, :k])], axis=1)


def join_router_stats(layers, mtp):
    """The router statistics of the layers (leading [MoE layers] dim) then of the MTP depths ([depths]);
    either may be None."""
    if layers is None or mtp is None:
        return mtp if layers is None else layers
    return jax.tree.map(lambda a, b: jnp.concatenate([a, b]), layers, mtp)


@dataclasses.dataclass(frozen=True)
class LayerCache:
    """One attention layer's generation cache (Transformer.extend's cache_k and cache_v for that
    layer): each token's shape in each of the two arrays, and whether they are a multi-latent layer's
    (the latent c [kv_lora_rank] and the rope key [qk_pos_emb_head_dim], token-major: mla.py) or a
    k and a v ([kv_heads, head_dim] each, head-major).

    Every layer's cache (this, StateCache, NoCache) answers the same questions: `empty` /
    `empty_pool` (the Generator's per-sequence cache of `slots` positions, the engine's pool of
    `slots` pool positions for `rows` rows), their logical axes, and the numbers it keeps per token
    and per sequence."""
    k: tuple[int, ...]
    v: tuple[int, ...]
    latent: bool

    def shape(self, which: str, batch: int, slots: int) -> tuple[int, ...]:
        """A per-sequence cache's shape: [B, T, features] (latent) or [B, kv_heads, T, head_dim]."""
        f = getattr(self, which)
        return (batch, slots) + f if self.latent else (batch, f[0], slots) + f[1:]

    def pool_shape(self, which: str, slots: int) -> tuple[int, ...]:
        """A block pool's shape (continuous batching): [pool slots, ...each token's shape]."""
        return (slots,) + getattr(self, which)

    @property
    def axes(self) -> tuple:
        return LATENT_CACHE if self.latent else ACT_CACHE

    @property
    def pool_axes(self) -> tuple:
        return LATENT_POOL if self.latent else ACT_POOL

    def empty(self, which: str, batch: int, slots: int, dtype):
        return logical_constraint(jnp.zeros(self.shape(which, batch, slots), dtype), self.axes)

    def empty_pool(self, which: str, slots: int, rows: int, dtype):
        return jnp.zeros(self.pool_shape(which, slots), dtype)

    def cache_axes(self, which: str):
        return self.axes

    def pool_axes_of(self, which: str):
        return self.pool_axes

    def numbers_per_token(self) -> int:
        return math.prod(self.k) + math.prod(self.v)

    def bytes_per_sequence(self, dtype) -> int:
        return 0


@dataclasses.dataclass(frozen=True)
class StateCache:
    """A Mamba layer's generation cache: its MambaState (conv windows in the compute dtype, the SSM
    state in fp32) as cache_k, cache_v None; the same size whatever the sequence's length (nothing
    per token). The engine keeps one state per batch row."""
    cfg: ModelConfig

    def empty(self, which: str, batch: int, slots: int, dtype):
        if which == "v":
            return None
        return MambaState(*(logical_constraint(s, a) for s, a in zip(empty_state(self.cfg, batch, dtype),
                                                                     state_axes())))

    def empty_pool(self, which: str, slots: int, rows: int, dtype):
        return None if which == "v" else empty_state(self.cfg, rows, dtype)

    def cache_axes(self, which: str):
        return None if which == "v" else state_axes()

    def pool_axes_of(self, which: str):
        return None if which == "v" else state_axes(None)

    def numbers_per_token(self) -> int:
        return 0

    def bytes_per_sequence(self, dtype) -> int:
        """The state's bytes: its numbers (mamba.state_numbers), the SSM state's 4 bytes each."""
        h, p, n = self.cfg.mamba_num_heads, self.cfg.mamba_head_dim, self.cfg.mamba_state_dim
        ssm = h * p * n
        return (state_numbers(self.cfg) - ssm) * jnp.dtype(dtype).itemsize + ssm * 4


@dataclasses.dataclass(frozen=True)
class NoCache:
    """An MLP or MoE layer of a hybrid: nothing kept between generation steps (its caches are None)."""

    def empty(self, which, batch, slots, dtype):
        return None

    def empty_pool(self, which, slots, rows, dtype):
        return None

    def cache_axes(self, which):
        return None

    def pool_axes_of(self, which):
        return None

    def numbers_per_token(self) -> int:
        return 0

    def bytes_per_sequence(self, dtype) -> int:
        return 0


def layer_caches(cfg: ModelConfig) -> list:
    """Each model layer's cache, in model order: LayerCache (attention's k and v, or multi-latent
    attention's latent), a hybrid's Mamba layers StateCache (a fixed-size state, nothing per token), its
    MLP and MoE layers NoCache. The multi-token prediction depths (model.mtp_num_layers) have none:
    generation runs the main output head only."""
    if cfg.multi_latent_attention:
        layer = LayerCache((cfg.kv_lora_rank,), (cfg.qk_pos_emb_head_dim,), True)
    else:
        layer = LayerCache((cfg.num_kv_heads, cfg.head_dim), (cfg.num_kv_heads, cfg.head_dim), False)
    if cfg.hybrid_layer_pattern:
        kinds = {"*": layer, "M": StateCache(cfg), "-": NoCache(), "E": NoCache()}
        return [kinds[kind] for kind in cfg.hybrid_pattern()]
    return [layer] * cfg.num_layers


def param_axes(model: nnx.Module) -> dict:
    """Nested dict (same structure as the pure parameter dict) of logical axis tuples."""
    def walk(node):
        if isinstance(node, nnx.Variable):
            return tuple(node.get_metadata()["axes"])
        return {k: walk(v) for k, v in node.items()}
    return walk(nnx.state(model, nnx.Param))
