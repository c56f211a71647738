"""One tensor-parallel rank of Megatron-Core's LLaVAModel modules, run on CPU over gloo (used by
test_vision_megatron.py).

    python megatron_vision_worker.py STEP_DIR[,STEP_DIR...] IMAGES.npy OUT RANK WORLD PORT

Builds, from the checkpoint's saved args, the three modules LLaVAModel holds under its own names:
`language_model` (GPTModel, local spec, as megatron_worker.py builds it), `vision_model`
(CLIPViTModel, model_subtype clip or siglip, the ViT layer spec without Transformer Engine, its
attention unmasked as megatron-core's Transformer Engine ViT spec builds it) and `vision_projection`
(MultimodalProjector, mlp or affine). For each checkpoint k (all of one tensor-parallel size WORLD) it
loads this rank's legacy file with load_state_dict(strict=True) (every name and shape as megatron-core's),
then on rank 0 saves
- OUT{k}_features.npy: the projected image features [images, features, D] (vision_model's output, the
  class token dropped for CLIP as LLaVAModel drops it, through vision_projection), and
- OUT{k}_keys.json: {key: global shape} of the modules' sharded_state_dict (what a torch_dist checkpoint
  holds), tensors only (a tensor factory's shape: null).

CLIPViTModel puts its position ids on CUDA when built: Tensor.cuda is the identity here; its ln_pre /
ln_post are megatron-core's torch LayerNorm wrapper (Transformer Engine's TENorm otherwise).
"""

import json
import os
import sys

import numpy as np
import torch
import torch.distributed as dist

from megatron_worker import build_model, init


def build_llava(args, tp):
    from megatron.core.models.vision.clip_vit_model import CLIPViTModel
    from megatron.core.models.vision.multimodal_projector import MultimodalProjector
    from megatron.core.models.vision.vit_layer_specs import get_vit_layer_with_local_spec
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.mlp import MLPSubmodules
    from megatron.core.transformer.torch_norm import WrappedTorchNorm
    from megatron.core.transformer.transformer_config import TransformerConfig
    v = args.megajax_vision
    act = {"gelu": torch.nn.functional.gelu,
           "gelu_tanh": lambda x: torch.nn.functional.gelu(x, approximate="tanh"),
           "quick_gelu": lambda x: x * torch.sigmoid(1.702 * x)}[v["activation"]]
    common = dict(add_bias_linear=True, tensor_model_parallel_size=tp, use_cpu_initialization=True,
                  params_dtype=torch.float32, hidden_dropout=0.0, attention_dropout=0.0, bias_activation_fusion=False,
                  bias_dropout_fusion=False, masked_softmax_fusion=False, persist_layer_norm=False,
                  gradient_accumulation_fusion=False, gated_linear_unit=False)
    vision_config = TransformerConfig(num_layers=v["num_layers"], hidden_size=v["hidden_size"],
                                      num_attention_heads=v["num_heads"], ffn_hidden_size=v["ffn_hidden_size"],
                                      normalization="LayerNorm", layernorm_epsilon=v["norm_eps"], add_qkv_bias=True,
                                      activation_func=act, **common)
    spec = get_vit_layer_with_local_spec()
    spec.submodules.self_attention.params["attn_mask_type"] = AttnMaskType.no_mask
    torch.Tensor.cuda = lambda self, *a, **k: self
    clip = v["form"] == "clip"
    vision_model = CLIPViTModel(vision_config, spec, add_class_token=clip, class_token_len=int(clip),
                                patch_dim=v["patch_size"], img_h=v["image_size"], img_w=v["image_size"],
                                model_subtype=v["form"], ln_pre_impl=WrappedTorchNorm, ln_post_impl=WrappedTorchNorm)
    projection_config = TransformerConfig(num_layers=1, hidden_size=args.hidden_size,
                                          ffn_hidden_size=args.hidden_size, num_attention_heads=tp,
                                          activation_func=torch.nn.functional.gelu, **common)
    projection = MultimodalProjector(projection_config, MLPSubmodules(linear_fc1=ColumnParallelLinear,
                                                                      linear_fc2=RowParallelLinear),
                                     v["projector"], v["hidden_size"])
    model = torch.nn.Module()  # LLaVAModel's attribute names
    model.language_model, model.vision_model, model.vision_projection = build_model(args, tp, 1, 0), vision_model, \
        projection
    return model


def main(step_dirs, images_file, out, rank, world, port):
    init(rank, world, port, world)
    for k, step_dir in enumerate(step_dirs.split(",")):
        run(step_dir, images_file, f"{out}{k}", rank, world)
    dist.barrier()


def run(step_dir, images_file, out, rank, world):
    args = torch.load(os.path.join(step_dir, "mp_rank_00", "model_optim_rng.pt"), weights_only=False)["args"]
    assert args.tensor_model_parallel_size == world, (args.tensor_model_parallel_size, world)
    model = build_llava(args, world)
    state = torch.load(os.path.join(step_dir, f"mp_rank_{rank:02d}", "model_optim_rng.pt"), weights_only=False)["model"]
    model.load_state_dict(state, strict=True)
    images = torch.from_numpy(np.load(images_file)).permute(0, 3, 1, 2).contiguous()  # [I, 3, H, W]
    with torch.no_grad():
        x = model.vision_model(images)
        x = model.vision_projection(x[:, int(args.megajax_vision["form"] == "clip"):])
    if rank == 0:
        np.save(out + "_features.npy", x.float().numpy())
        from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory
        keys = {}  # a factory (SwiGLU's linear_fc1 at TP > 1): its key, its stored form not judged
        for name in ("language_model", "vision_model", "vision_projection"):
            for t in getattr(model, name).sharded_state_dict(prefix=f"{name}.").values():
                if isinstance(t, (ShardedTensor, ShardedTensorFactory)):
                    keys[t.key] = list(t.global_shape) if isinstance(t, ShardedTensor) else None
        with open(out + "_keys.json", "w") as f:
            json.dump(keys, f)


if __name__ == "__main__":
    step, images, out, rank, world, port = sys.argv[1:]
    main(step, images, out, int(rank), int(world), int(port))
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
