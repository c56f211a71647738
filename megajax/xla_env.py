"""XLA flags megajax's commands set before JAX starts (XLA reads XLA_FLAGS once, at its first use).

- `--xla_force_host_platform_device_count=N` for `mesh.cpu_devices` (simulated CPU devices).
- On a CPU-only run, `--xla_backend_extra_options=-unroll-full-max-count=8`: XLA:CPU's LLVM
  pipeline otherwise fully unrolls loops of 16 to 32 and more iterations inside a fused kernel
  (the 16- and 32-wide inner dimensions of Mamba's heads and chunks, the optimizer update of a
  [..., 16, 16] parameter), copying an inlined `exp` into each iteration, and then spends up to
  2 s optimising that one kernel (`exp(where(mask, x, -inf))` over [2, 16, 4, 32, 32]: 1.5 s of
  code generation against 20 ms with the cap). Loops of up to 8 iterations (a 64-wide row in
  8-float AVX2 vectors) still unroll, partial unrolling and vectorisation are unchanged, and results
  differ from LLVM's defaults only by fp32 rounding. docs/performance.md ("Compile time on CPU")
  has the measurements.

- With tensor parallelism and parallel.tp_comm_overlap where a GPU may run (`TP_OVERLAP_FLAGS`):
  `--xla_gpu_enable_latency_hiding_scheduler=true` (XLA:GPU's scheduler then starts each
  asynchronous collective, the collective matmuls' collective-permutes among them
  (megajax/parallel/tensor.py), early enough to run beside independent products; off by default),
  `--xla_gpu_threshold_for_windowed_einsum_mib=0` and `--xla_gpu_multi_streamed_windowed_einsum=true`
  (the products XLA partitions itself that gather or scatter an operand become windowed einsums at
  every size, not only above 100000 MiB, their steps on separate streams). Each name exists in
  jaxlib 0.10's XLA (tests/test_tp_overlap.py starts a process with them; XLA aborts on a flag it
  does not know); `TP_OVERLAP_OFF` are the same flags at XLA's defaults, for a run without them.

Nothing is added where the caller's XLA_FLAGS already names the flag (for LLVM's defaults:
`--xla_backend_extra_options=-unroll-full-max-count=4294967295`, the option's own default), and
the LLVM option is never set where a GPU or TPU backend may run: XLA hands the same options to its
GPU compilers; the GPU options only where a GPU may run.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import pkgutil

DEVICE_COUNT_FLAG = "--xla_force_host_platform_device_count"
BACKEND_OPTIONS_FLAG = "--xla_backend_extra_options"
CPU_CODEGEN_OPTIONS = "-unroll-full-max-count=8"
TP_OVERLAP_FLAGS = ("--xla_gpu_enable_latency_hiding_scheduler=true",
                    "--xla_gpu_threshold_for_windowed_einsum_mib=0",
                    "--xla_gpu_multi_streamed_windowed_einsum=true")
TP_OVERLAP_OFF = ("--xla_gpu_enable_latency_hiding_scheduler=false",
                  "--xla_gpu_threshold_for_windowed_einsum_mib=100000",
                  "--xla_gpu_multi_streamed_windowed_einsum=false")


def accelerator_plugins() -> list[str]:
    """The JAX backend plugins installed besides the CPU (found as JAX finds them: the
    `jax_plugins` namespace package and entry points, and libtpu), without importing JAX."""
    names = [ep.name for ep in importlib.metadata.entry_points(group="jax_plugins")]
    try:
        import jax_plugins
        names += [m.name for m in pkgutil.iter_modules(jax_plugins.__path__)]
    except ImportError:
        pass
    if importlib.util.find_spec("libtpu") is not None:
        names.append("libtpu")
    return sorted(set(names))


def cpu_only(environ=os.environ) -> bool:
    """Whether this process can only run on the CPU: JAX_PLATFORMS names the CPU alone, or is unset
    and no accelerator plugin is installed."""
    platforms = [p.strip() for p in environ.get("JAX_PLATFORMS", "").split(",") if p.strip()]
    if platforms:
        return set(platforms) == {"cpu"}
    return not accelerator_plugins()


def gpu_possible(environ=os.environ) -> bool:
    """Whether this process may run on a GPU: JAX_PLATFORMS names cuda, rocm or gpu, or is unset and
    a CUDA or ROCm plugin is installed."""
    platforms = [p.strip() for p in environ.get("JAX_PLATFORMS", "").split(",") if p.strip()]
    if platforms:
        return bool({"cuda", "rocm", "gpu"} & set(platforms))
    return any("cuda" in name or "rocm" in name for name in accelerator_plugins())


def prepare(cpu_devices: int = 0, environ=os.environ, tensor_overlap: bool = False) -> str:
    """Adds megajax's flags to `environ["XLA_FLAGS"]` (the simulated device count when
    `cpu_devices` > 0, the CPU code-generation options on a CPU-only run, the tensor-parallel overlap
    options with `tensor_overlap` where a GPU may run), each unless the caller set it already; returns
    the resulting XLA_FLAGS. Has no effect once JAX has compiled."""
    flags = environ.get("XLA_FLAGS", "")
    add = []
    if cpu_devices > 0 and DEVICE_COUNT_FLAG not in flags:
        add.append(f"{DEVICE_COUNT_FLAG}={cpu_devices}")
    if BACKEND_OPTIONS_FLAG not in flags and cpu_only(environ):
        add.append(f"{BACKEND_OPTIONS_FLAG}={CPU_CODEGEN_OPTIONS}")
    if tensor_overlap and gpu_possible(environ):
        add += [f for f in TP_OVERLAP_FLAGS if f.split("=")[0] not in flags]
    if add:
        environ["XLA_FLAGS"] = " ".join([flags, *add]).strip()
    return environ.get("XLA_FLAGS", "")
