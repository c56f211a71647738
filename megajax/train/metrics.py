"""What the user sees: log lines, metrics.jsonl, TensorBoard events, progress bar."""

from __future__ import annotations

import json
import math
import os
import resource
import sys
from pathlib import Path

import jax


def device_memory_gib() -> tuple[float | None, str]:
    """(GiB in use on the first local device, or host peak RSS on CPU; label)."""
    try:
        stats = jax.local_devices()[0].memory_stats()
    except Exception:
        stats = None
    if stats and "bytes_in_use" in stats:
        return stats["bytes_in_use"] / 2**30, "device"
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, "host peak RSS"


def readable_rate(flops_per_sec: float) -> str:
    """FLOP/s with the SI prefix that keeps three significant digits readable: '25.3 GFLOP/s'."""
    for scale, prefix in ((1e15, "P"), (1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(flops_per_sec) >= scale:
            return f"{flops_per_sec / scale:.3g} {prefix}FLOP/s"
    return f"{flops_per_sec:.3g} FLOP/s"


def readable_bytes(n: float) -> str:
    """Bytes in binary units with three significant digits: '706 MiB', '1.05 GiB'."""
    for scale, unit in ((2**40, "TiB"), (2**30, "GiB"), (2**20, "MiB"), (2**10, "KiB")):
        if abs(n) >= scale:
            return f"{n / scale:.3g} {unit}"
    return f"{n:.0f} B"


def readable_percent(fraction: float) -> str:
    """A fraction as a percentage that never reads 0.0% when it is not zero: '7.6%', '0.012%'."""
    pct = 100 * fraction
    return f"{pct:.1f}%" if pct >= 1 or pct == 0 else f"{pct:.2g}%"


def format_line(r: dict, total_steps: int) -> str:
    parts = [f"step {r['step']:>{len(str(total_steps))}d}/{total_steps}"]
    if "consumed_samples" in r:
        parts.append(f"consumed samples {r['consumed_samples']:,}")
    parts += [f"loss {r['loss']:.4f}", f"lr {r['lr']:.3e}", f"grad norm {r['grad_norm']:.3f}"]
    if r.get("loss_scale") is not None:
        parts.append(f"loss scale {r['loss_scale']:.0f}")
    parts.append(f"skipped {r.get('skipped_steps', 0)}" + (f" ({r['note']})" if r.get("note") else ""))
    if "moe_aux_loss" in r:
        parts.append(f"aux {r['moe_aux_loss']:.4f} z {r['moe_z_loss']:.2e} experts "
                     f"{100 * r['moe_min_expert_share']:.1f}-{100 * r['moe_max_expert_share']:.1f}%"
                     + (f" dropped {100 * r['moe_dropped_fraction']:.2f}%" if r['moe_dropped_fraction'] else ""))
    parts += [f"{r['tokens_per_sec']:,.0f} tok/s", f"{readable_rate(r['tflops_per_device'] * 1e12)}/dev",
              f"MFU {readable_percent(r['mfu'])}" if r.get("mfu") is not None else "MFU n/a",
              f"{1000 * r['step_time']:.1f} ms/step"]
    if r.get("data_wait"):
        parts.append(f"data wait {readable_percent(r['data_wait'])}")
    if r.get("memory_gib") is not None:
        parts.append(f"mem {readable_bytes(r['memory_gib'] * 2**30)}")
    return " | ".join(parts)


def json_safe(record: dict) -> dict:
    """Non-finite floats as null: JSON has no NaN or Infinity, and strict parsers reject them."""
    return {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in record.items()}


def truncate_records(path: Path, last_step: int) -> None:
    """Drops the records of steps after `last_step` from a metrics.jsonl (atomically)."""
    if not path.is_file():
        return
    kept, dropped = [], 0
    for line in path.read_text().splitlines():
        try:
            step = json.loads(line).get("step")
        except ValueError:
            step = None  # a line cut short by a crash
        if isinstance(step, int) and step <= last_step:
            kept.append(line)
        else:
            dropped += 1
    if dropped:
        tmp = path.with_suffix(".jsonl.tmp")
        tmp.write_text("".join(line + "\n" for line in kept))
        os.replace(tmp, path)


def _import_summary_writer():
    """tensorboardX's SummaryWriter, imported without PyTorch.

    tensorboardX imports PyTorch whenever it is installed (2.5-4 s before a run's first step on a
    2-core CPU), only to accept torch tensors as values; megajax logs Python floats. While
    tensorboardX loads, `import torch` is answered with ImportError (tensorboardX's own fallback
    for a machine without PyTorch), unless PyTorch is already loaded."""
    if "tensorboardX" in sys.modules or "torch" in sys.modules:
        from tensorboardX import SummaryWriter
        return SummaryWriter
    sys.modules["torch"] = None  # `import torch` -> ImportError
    try:
        from tensorboardX import SummaryWriter
    finally:
        if sys.modules.get("torch", 0) is None:
            del sys.modules["torch"]
    return SummaryWriter


def summary_writer(logdir: Path, say) -> object | None:
    """tensorboardX's SummaryWriter, or None (after one line through `say`) when it is not installed."""
    try:
        SummaryWriter = _import_summary_writer()
    except ImportError:
        say("megajax: note: TensorBoard event files need tensorboardX (pip install tensorboardX); this run "
            "logs to metrics.jsonl only. Set logging.tensorboard=false to silence this note.")
        return None
    return SummaryWriter(str(logdir))


class MetricsLogger:
    """Writes each record to metrics.jsonl (and TensorBoard); prints on process 0."""

    def __init__(self, run_dir: Path, *, tensorboard: bool, progress: bool | None, total_steps: int,
                 start_step: int = 0, resumed: bool = False):
        """`resumed`: the run continues from a checkpoint at `start_step`; records of later steps (written
        before a crash, and about to be written again) are dropped from metrics.jsonl."""
        self.is_main = jax.process_index() == 0
        self.total_steps = total_steps
        path = run_dir / "metrics.jsonl"
        if self.is_main and resumed:
            truncate_records(path, start_step)
        self.jsonl = open(path, "a") if self.is_main else None
        show_bar = sys.stderr.isatty() if progress is None else progress
        self.bar = None
        if show_bar and self.is_main:
            from tqdm import tqdm
            self.bar = tqdm(total=total_steps, initial=start_step, unit="step", dynamic_ncols=True)
        self.tb = None
        if tensorboard and self.is_main:
            self.tb = summary_writer(run_dir / "tensorboard", self.print)

    def print(self, text: str) -> None:
        if not self.is_main:
            return
        if self.bar is not None:
            self.bar.write(text)
        else:
            print(text, flush=True)

    def advance(self, n: int = 1) -> None:
        if self.bar is not None:
            self.bar.update(n)

    def log(self, record: dict, console: bool = True) -> None:
        if not self.is_main:
            return
        self.jsonl.write(json.dumps(json_safe(record), allow_nan=False) + "\n")
        self.jsonl.flush()
        if self.tb is not None:
            for k, v in record.items():
                if k != "step" and isinstance(v, (int, float)) and v == v:
                    self.tb.add_scalar(f"train/{k}", v, record["step"])
            self.tb.flush()
        if console and "loss" in record:
            self.print(format_line(record, self.total_steps))

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        if self.jsonl is not None:
            self.jsonl.close()
        if self.tb is not None:
            self.tb.close()
