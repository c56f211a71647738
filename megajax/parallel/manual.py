"""shard_map for the explicit collectives, outside the pipeline stages and inside them.

Each explicit collective of megajax (tensor and sequence parallelism's products and lookups,
context-parallel attention, the fused attention kernels per shard, the MoE dispatch) is written
once, as a function of the shards one device holds. `shard_map_fn` makes it a function of whole
arrays: a `shard_map` over the mesh where XLA partitions the rest of the program, and the local
function itself inside the pipeline's stage loop, which is already manual over every mesh axis
(megajax/parallel/pipeline.py), so that the pipelined and the plain step run the same code and no
shard_map is ever nested in another. Whether a call runs inside the stage loop is read from the
context it is traced in, never passed.
"""

from __future__ import annotations

from typing import Callable

import jax

from megajax.mesh import mesh_sizes


def manual_everywhere() -> bool:
    """Whether the code being traced runs inside a shard_map manual over every mesh axis of size > 1
    (the pipeline's stage loop)."""
    here = jax.sharding.get_abstract_mesh()
    if here.empty or not here.manual_axes:
        return False
    return all(a in here.manual_axes or n == 1 for a, n in mesh_sizes(here).items())


def shard_map_fn(local: Callable, mesh, in_specs: tuple, out_specs, *, check_vma: bool = True) -> Callable:
    """jax.shard_map(local, ...) as a function of its positional arguments; traced inside the stage
    loop (`manual_everywhere`), `local` itself on the shards the loop holds."""
    plain = jax.shard_map(local, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=check_vma)

    def call(*args):
        if manual_everywhere():
            return local(*args)
        assert not jax.sharding.get_abstract_mesh().manual_axes, "megajax nests no shard_map in a partly manual one"
        return plain(*args)

    return call
