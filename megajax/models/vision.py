"""Vision-language models (LLaVA; Megatron-Core's LLaVAModel): a ViT image encoder, a projector and a
language model of any family.

    images [B, N, H, W, 3] -> patches -> ViT (features of layer `feature_layer`) [-> pixel shuffle]
        -> projector
        -> [B, N x image_seq_length, D]: the embeddings of the text's image placeholders, in order
    tokens [B, L] -> embed, placeholders replaced -> the language model's layers -> logits [B, L, V]

Tiled images (model.vision.max_num_tiles > 1, megajax/data/tiles.py) come as their tiles: the N
pictures of a row are its images' tiles, image after image, each with its image_seq_length
placeholders in the text; a row's tile axis is padded at its end with pictures that no placeholder
takes (the loader's [max_tiles, ...] per sample), so the k-th placeholder takes the k-th feature and
only the valid tiles' features land in the text, whatever the row's tile count.

The encoder (SigLIP or CLIP form, model.vision.form) is pre-norm: x + attn(ln1(x)), then
x + mlp(ln2(x)), non-causal attention over the patches, learned position embeddings; the SigLIP form
has no class token, the CLIP form a class token and a layernorm before the first layer. Both end in a
post-layernorm (SigLIP's over every patch: `last_hidden_state`; CLIP's over the class token: `pooled`),
which LLaVA's features, taken from one layer's output, do not use. Only the layers up to the feature
layer run.

Parameters (beside the language model's, megajax/models/layout.py):

    vision/patch_embed/kernel  [p, p, 3, Dv]     (+ bias [Dv], SigLIP): a conv of stride p, as a product
    vision/class_embedding     [Dv]              CLIP form only
    vision/pos_embed           [P (+1), Dv]
    vision/pre_norm/scale|bias [Dv]              CLIP form only
    vision/layers/...          [Lv, ...]         ln1, attn/q|k|v|o, ln2, fc1, fc2 (all with biases)
    vision/post_norm/scale|bias [Dv]
    projector/fc1/kernel       [Dv, D] (+ bias)  mlp: fc1, GELU, fc2 [D, D]; affine: fc1 alone
                                                 ([4 Dv, D] under pixel_shuffle)

Only logical axis names appear: the encoder's and projector's own `vision_heads` and `vision_mlp`
(split over the tensor axis as parallel.encoder_tensor_parallel says, megajax/mesh.py), `embed`,
`head_dim`; the encoder's stack is `stack`, held whole by every device like the pipeline's shared
stacks. Under pipeline parallelism the encoder and projector run with the embedding on the first
stage (megajax/train/pipeline_step.py), and their weights are kept split over `pipeline` between steps
(megajax.mesh.encoder_storage_axes).
"""

from __future__ import annotations

import math
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from megajax.config import ModelConfig, VisionConfig
from megajax.errors import DataError
from megajax.mesh import logical_constraint, manual_split_axes, one_device_positions
from megajax.models.attention import make_attention_core
from megajax.models.layers import Dense, LayerNorm, dropout, normal_init
from megajax.models.transformer import RESIDUAL, Transformer, _add_layers_axis

# The encoder's activations: [images, patches, vision width]; q/k/v [images, patches, heads, head_dim].
ACT_VISION = ("batch", None, "embed")
ACT_VISION_HEADS = ("batch", None, "vision_heads", "head_dim")
ACT_VISION_MLP = ("batch", None, "vision_mlp")
IMAGE_AXES = (None, "batch", None, None, None, None)  # a batch's images: [accumulation, B, N, H, W, 3]

ACTIVATIONS: dict[str, Callable] = {
    "gelu": lambda x: jax.nn.gelu(x, approximate=False),
    "gelu_tanh": lambda x: jax.nn.gelu(x, approximate=True),
    "quick_gelu": lambda x: x * jax.nn.sigmoid(1.702 * x),
}


class EncoderLayer(nnx.Module):
    """One ViT layer: x + attn(ln1(x)), then x + fc2(act(fc1(ln2(x))))."""

    def __init__(self, v: VisionConfig, *, dtype, dot, rngs: nnx.Rngs):
        d, h, f = v.hidden_size, v.num_heads, v.ffn_hidden_size
        hd = d // h
        common = dict(use_bias=True, init_std=v.init_std, dtype=dtype, dot_general=dot, rngs=rngs)
        self.ln1 = LayerNorm(d, eps=v.norm_eps, dtype=dtype)
        self.q = Dense(d, (h, hd), axes=("embed", "vision_heads", "head_dim"), **common)
        self.k = Dense(d, (h, hd), axes=("embed", "vision_heads", "head_dim"), **common)
        self.v = Dense(d, (h, hd), axes=("embed", "vision_heads", "head_dim"), **common)
        self.o = Dense((h, hd), d, axes=("vision_heads", "head_dim", "embed"), **common)
        self.ln2 = LayerNorm(d, eps=v.norm_eps, dtype=dtype)
        self.fc1 = Dense(d, f, axes=("embed", "vision_mlp"), **common)
        self.fc2 = Dense(f, d, axes=("vision_mlp", "embed"), **common)
        self.activation = v.activation

    def __call__(self, x_IxPxD: jax.Array, core: Callable) -> jax.Array:
        h = self.ln1(x_IxPxD)
        q, k, v = (logical_constraint(p(h), ACT_VISION_HEADS) for p in (self.q, self.k, self.v))
        a = core(q, k, v, segment_ids=None, causal=False, dropout_rate=0.0, dropout_rng=None)
        x = logical_constraint(x_IxPxD + self.o(a), ACT_VISION)
        h = logical_constraint(ACTIVATIONS[self.activation](self.fc1(self.ln2(x))), ACT_VISION_MLP)
        return logical_constraint(x + self.fc2(h), ACT_VISION)


class VisionEncoder(nnx.Module):
    """The ViT: images [I, H, W, 3] -> hidden states [I, P (+1 class token), Dv]."""

    def __init__(self, v: VisionConfig, *, dtype, dot=jax.lax.dot_general, recompute: str = "none",
                 rngs: nnx.Rngs):
        self.v, self.dtype = v, dtype
        p, d = v.patch_size, v.hidden_size
        # SigLIP's patch embedding has a bias, CLIP's not.
        self.patch_embed = Dense((p, p, 3), d, axes=(None, None, None, "embed"), use_bias=not v.class_token,
                                 init_std=v.init_std, dtype=dtype, dot_general=dot, rngs=rngs)
        if v.class_token:
            self.class_embedding = nnx.Param(normal_init(rngs.params(), (d,), v.init_std), axes=("embed",))
            self.pre_norm = LayerNorm(d, eps=v.norm_eps, dtype=dtype)
        positions = v.num_patches + v.class_token
        self.pos_embed = nnx.Param(normal_init(rngs.params(), (positions, d), v.init_std), axes=("position", "embed"))

        @nnx.split_rngs(splits=v.num_layers)
        @nnx.vmap(in_axes=(0,), out_axes=0, axis_size=v.num_layers)
        def make(rngs):
            return EncoderLayer(v, dtype=dtype, dot=dot, rngs=rngs)

        self.layers = make(rngs)
        _add_layers_axis(self.layers, "stack")
        self.post_norm = LayerNorm(d, eps=v.norm_eps, dtype=dtype)
        self.core = make_attention_core("xla", recompute)
        self.recompute = recompute

    def embed(self, images_IxHxWxC: jax.Array) -> jax.Array:
        """Patch and position embeddings (the class token first, then the CLIP form's pre-layernorm):
        the first layer's input [I, P (+1), Dv]."""
        i, hgt, wid, c = images_IxHxWxC.shape
        p = self.v.patch_size
        hgt, wid = hgt // p * p, wid // p * p  # pixels past the last whole patch: dropped (a conv of stride p)
        x = images_IxHxWxC[:, :hgt, :wid].astype(self.dtype).reshape(i, hgt // p, p, wid // p, p, c)
        patches = x.transpose(0, 1, 3, 2, 4, 5).reshape(i, (hgt // p) * (wid // p), p, p, c)  # row-major patches
        x = self.patch_embed(patches)  # [I, P, Dv]
        if self.v.class_token:
            cls = jnp.broadcast_to(self.class_embedding[...].astype(self.dtype), (i, 1, x.shape[-1]))
            x = jnp.concatenate([cls, x], axis=1)
        x = x + self.pos_embed[...].astype(self.dtype)
        if self.v.class_token:
            x = self.pre_norm(x)
        return logical_constraint(x, ACT_VISION)

    def hidden_states(self, images_IxHxWxC: jax.Array, layers: int) -> jax.Array:
        """The output of encoder layer `layers` (0: the embeddings), layers scanned: [I, P (+1), Dv]."""
        x = self.embed(images_IxHxWxC)
        if layers == 0:
            return x
        graphdef, state = nnx.split(self.layers)
        state = jax.tree.map(lambda a: a[:layers], state)

        def body(x, params):
            return nnx.merge(graphdef, params)(x, self.core), None

        if self.recompute == "full":
            body = jax.checkpoint(body, prevent_cse=False)
        return jax.lax.scan(body, x, state)[0]

    def last_hidden_state(self, images_IxHxWxC: jax.Array) -> jax.Array:
        """Hugging Face's vision model output: every layer, then (SigLIP) the post-layernorm."""
        x = self.hidden_states(images_IxHxWxC, self.v.num_layers)
        return x if self.v.class_token else self.post_norm(x)

    def pooled(self, images_IxHxWxC: jax.Array) -> jax.Array:
        """The CLIP form's image embedding [I, Dv]: the class token's last state, post-layernormed."""
        return self.post_norm(self.hidden_states(images_IxHxWxC, self.v.num_layers)[:, 0])

    def features(self, images_IxHxWxC: jax.Array) -> jax.Array:
        """LLaVA's image features: layer `feature_layer`'s output, the class token dropped by
        feature_select=default, pixel-shuffled by pixel_shuffle: [I, image_seq_length, feature_width]."""
        x = self.hidden_states(images_IxHxWxC, self.v.feature_layers())
        x = x[:, 1:] if self.v.feature_select == "default" else x
        return pixel_shuffle(x) if self.v.pixel_shuffle else x


def pixel_shuffle(x_IxPxD: jax.Array) -> jax.Array:
    """model.vision.pixel_shuffle: the row-major patch grid [I, h x w, D] regrouped into [I, h/2 x w/2, 4 D],
    feature (i, j) the concatenation of patches (2i, 2j), (2i, 2j+1), (2i+1, 2j), (2i+1, 2j+1) (top-left,
    top-right, bottom-left, bottom-right; Megatron's and InternVL's pixel_shuffle, version 2), the
    features row-major."""
    i, p, d = x_IxPxD.shape
    side = math.isqrt(p)
    x = x_IxPxD.reshape(i, side // 2, 2, side // 2, 2, d).transpose(0, 1, 3, 2, 4, 5)
    return logical_constraint(x.reshape(i, p // 4, 4 * d), ACT_VISION)


class Projector(nnx.Module):
    """Image features [.., Dv] -> the language model's width [.., D]: mlp (fc1, GELU, fc2) or affine (fc1)."""

    def __init__(self, v: VisionConfig, hidden_size: int, *, dtype, dot, init_std: float, rngs: nnx.Rngs):
        common = dict(use_bias=True, init_std=init_std, dtype=dtype, dot_general=dot, rngs=rngs)
        self.fc1 = Dense(v.feature_width, hidden_size, axes=("embed", "vision_mlp"), **common)
        self.fc2 = Dense(hidden_size, hidden_size, axes=("vision_mlp", "embed"), **common) if v.projector == "mlp" else None

    def __call__(self, x: jax.Array) -> jax.Array:
        h = self.fc1(x)
        return h if self.fc2 is None else self.fc2(ACTIVATIONS["gelu"](h))


class VisionLanguageModel(Transformer):
    """A Transformer whose image placeholders (model.vision.image_token_id) take the projected image
    features: the k-th placeholder of a row the k-th feature of that row's images, image after image.
    `vision_dot`: the encoder's and projector's product (plain: XLA partitions it over the mesh)."""

    def __init__(self, cfg: ModelConfig, *, vision_dot=jax.lax.dot_general, rngs: nnx.Rngs, **kwargs):
        super().__init__(cfg, rngs=rngs, **kwargs)
        v = cfg.vision
        self.vision = VisionEncoder(v, dtype=self.dtype, dot=vision_dot, recompute=self.recompute, rngs=rngs)
        self.projector = Projector(v, cfg.hidden_size, dtype=self.dtype, dot=vision_dot, init_std=cfg.init_std,
                                   rngs=rngs)

    def image_embeddings(self, images_BxNxHxWxC: jax.Array) -> jax.Array:
        """[B, N x image_seq_length, D]: each row's images' projected features, in order."""
        b, n = images_BxNxHxWxC.shape[:2]
        feats = self.vision.features(images_BxNxHxWxC.reshape((b * n,) + images_BxNxHxWxC.shape[2:]))
        out = self.projector(feats)
        return out.reshape(b, n * out.shape[1], out.shape[2])

    def splice_image_features(self, x_BxLxD, tokens_BxL, feats_BxMxD):
        """Generation's prefill (Transformer.extend): the features in place of the placeholders."""
        return splice_images(x_BxLxD, tokens_BxL, feats_BxMxD, self.cfg.vision.image_token_id)

    def embed_input(self, tokens_BxL, positions_BxL, dropout_rng, images_BxNxHxWxC=None):
        """The first layer's input [B, L, D]: token embeddings, the placeholders' replaced by the
        images' features (text alone without `images`), then their dropout."""
        x = self.embed_tokens(tokens_BxL, positions_BxL)
        if images_BxNxHxWxC is not None:
            check_image_tokens(tokens_BxL, images_BxNxHxWxC, self.cfg.vision)
            x = splice_images(x, tokens_BxL, self.image_embeddings(images_BxNxHxWxC), self.cfg.vision.image_token_id)
        return logical_constraint(dropout(x, self.cfg.hidden_dropout, dropout_rng, RESIDUAL), RESIDUAL)


def splice_images(x_BxLxD: jax.Array, tokens_BxL: jax.Array, feats_BxMxD: jax.Array, image_token_id: int):
    """x with its placeholder positions replaced by the features, the k-th placeholder of a row (in the
    sequence's natural order) taking the row's k-th feature.

    The placeholders are counted over the whole row in its natural order, then each slot of x takes
    its own: under context parallelism the sequence is laid out in load-balanced chunks
    (megajax/mesh.py); inside a pipeline stage (manual over every mesh axis) the tokens are this
    context shard's [B, L / context] and are gathered over `context` first (ints: no gradient), and
    with sequence parallelism x holds this tensor rank's part of the shard [B, L / (context tp), D]."""
    is_image_BxL, slots = whole_row(tokens_BxL == image_token_id)
    natural = jnp.zeros_like(is_image_BxL).at[:, slots].set(is_image_BxL)  # [B, L] in natural order
    k_natural = jnp.cumsum(natural, axis=1) - 1  # the k of each natural position's placeholder
    where = natural_positions(RESIDUAL, x_BxLxD.shape, axis=1)  # x's slots' natural positions [n]
    is_image, k = natural[:, where], k_natural[:, where]
    k = jnp.clip(k, 0, feats_BxMxD.shape[1] - 1)
    taken = jnp.take_along_axis(feats_BxMxD, k[..., None], axis=1).astype(x_BxLxD.dtype)
    return logical_constraint(jnp.where(is_image[..., None], taken, x_BxLxD), RESIDUAL)


def natural_positions(names: tuple, shape: tuple[int, ...], axis: int) -> jax.Array:
    """int32 [shape[axis]]: the natural sequence position of each slot of dim `axis` of an activation
    traced here with logical dims `names` (megajax.mesh.one_device_positions)."""
    n = shape[axis]
    layout = one_device_positions(names, shape)
    where = None if layout is None else layout[1][axis]
    if where is None:
        return jnp.arange(n, dtype=jnp.int32)
    if isinstance(where, int) or getattr(where, "ndim", 1) == 0:  # a contiguous block's start
        return where + jnp.arange(n, dtype=jnp.int32)
    return where


def whole_row(x_BxL: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(x [B, L] whole along the sequence, in the layout's order; the natural position of each of its
    slots [L]): a shard of manual mesh axes (a pipeline stage's context shard) gathered over them."""
    names = ("batch", "length")
    slots = natural_positions(names, x_BxL.shape, axis=1)
    axes = manual_split_axes(names, 1)
    if not axes:
        return x_BxL, slots
    gather = lambda a, dim: jax.lax.all_gather(a, axes, axis=dim, tiled=True)
    return gather(x_BxL, 1), gather(slots, 0)


def check_image_tokens(tokens, images, v: VisionConfig) -> None:
    """One clear error when a row's placeholders are not its images' features (image_seq_length per
    image; tiled: per valid tile, the row's pictures ending in padding) or the images are not
    image_size square; nothing for traced arrays (under jit the shapes are
    checked, the counts by the data pipeline that builds the batch)."""
    shape = tuple(images.shape)
    if len(shape) != 5 or shape[2:] != (v.image_size, v.image_size, 3):
        raise DataError(f"images have shape {list(shape)}; expected [batch, images per row, {v.image_size}, "
                        f"{v.image_size}, 3] (model.vision.image_size={v.image_size}, RGB last).")
    if isinstance(tokens, jax.core.Tracer):
        return
    counts = np.sum(np.asarray(tokens) == v.image_token_id, axis=-1).reshape(-1)
    want = shape[1] * v.image_seq_length
    if v.tiled:  # the row's own tiles first, then padding pictures: whole tiles, at most the pictures given
        bad = np.flatnonzero((counts % v.image_seq_length != 0) | (counts > want))
        if bad.size:
            row = int(bad[0])
            raise DataError(f"row {row} of the batch holds {int(counts[row])} image placeholders "
                            f"(model.vision.image_token_id={v.image_token_id}) for its {shape[1]} tile pictures; "
                            f"a tiled image's text takes image_seq_length={v.image_seq_length} placeholders per "
                            f"tile, so a multiple of it and at most {want}.")
        return
    bad = np.flatnonzero(counts != want)
    if bad.size:
        row = int(bad[0])
        raise DataError(f"row {row} of the batch holds {int(counts[row])} image placeholders "
                        f"(model.vision.image_token_id={v.image_token_id}) but {shape[1]} image(s) x "
                        f"{v.image_seq_length} features = {want}; the text must repeat the placeholder "
                        f"image_seq_length={v.image_seq_length} times per image.")


def build_model(cfg: ModelConfig, **kwargs) -> Transformer:
    """The model of `cfg`: a VisionLanguageModel with model.vision, else a Transformer."""
    if cfg.vision is None:
        kwargs.pop("vision_dot", None)
        return Transformer(cfg, **kwargs)
    return VisionLanguageModel(cfg, **kwargs)


def encoder_forward_flops(v: VisionConfig, text_hidden: int) -> tuple[float, float]:
    """Forward FLOPs of one image (2 per multiply-add): (the patch embedding and the encoder layers that
    run, their attention included; the projector)."""
    t, d, f = v.num_patches + v.class_token, v.hidden_size, v.ffn_hidden_size
    per_layer = 2 * t * (4 * d * d + 2 * d * f) + 2 * 2 * t * t * d  # q, k, v, o, fc1, fc2; QK^T and AV
    patch = 2 * v.num_patches * v.patch_size ** 2 * 3 * d
    feats = v.image_seq_length
    projector = 2 * feats * v.feature_width * text_hidden + (2 * feats * text_hidden * text_hidden if v.projector == "mlp" else 0)
    return float(v.feature_layers() * per_layer + patch), float(projector)
