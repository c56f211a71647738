"""Reading the torch.save'd files of a Megatron checkpoint (legacy rank files, a torch_dist
checkpoint's common state) without running what they name.

A Megatron-LM run stores its whole `args` Namespace (815 fields in megatron-core 0.19), and with
it objects of Megatron's own classes: enums such as `AttnBackend` and `InferenceCudaGraphScope`,
config dataclasses, the rerun state machine's state. torch's weights-only loader refuses every
class it was not told about, and telling it means importing Megatron (which need not be installed,
and whose list of classes changes with each release). Here each `megatron.*` name the file asks for
gets a stand-in instead (MegatronObject: the class's module and name, the arguments the object was
built with, its state; an enum member reads as its value), so the args fields megajax reads come
through, and no Megatron code is imported or run. Besides tensors and stand-ins, only a short list
of plain classes is admitted (argparse.Namespace, types.SimpleNamespace, signal.Signals,
pathlib.PosixPath, io.BytesIO, numpy arrays, dtypes and scalars, torch.Generator); anything else is
refused by name, and `trust=True` (`--trust-checkpoint` on the command line) loads the file with
Python's full unpickler (Megatron's classes still stand-ins), for a checkpoint whose origin the user
vouches for.
"""

from __future__ import annotations

import argparse
import io
import pathlib
import pickle
import re
import signal
import types
import zipfile
from pathlib import Path

import numpy as np

from megajax.errors import CheckpointError

TRUST_OPTION = "--trust-checkpoint"
TRUST_KEY = "checkpoint.trust_load"
TRUST_HINT = (f"if you trust the file, pass {TRUST_OPTION} (megajax import / export; {TRUST_KEY}=true for "
              f"checkpoint.load), which unpickles it with Python's full pickle: it can run any code the file names")
MEGATRON = "megatron."
_MAX_STAND_INS = 256  # distinct Megatron classes in one file; a real args Namespace holds a handful


class MegatronObject:
    """A stand-in for an object of a Megatron class read from a checkpoint, which megajax neither imports
    nor runs. `megatron_class` names the class; `args` are what the object was built with (an enum
    member's value); `state` what it held. An enum member compares equal to, and reads as, its value."""
    megatron_class = ""
    args: tuple = ()
    state = None

    def __new__(cls, *args):
        self = object.__new__(cls)
        self.args = args
        return self

    def __init__(self, *args):
        pass

    def __setstate__(self, state):
        self.state = state

    @property
    def value(self):
        return self.args[0] if len(self.args) == 1 else self.args

    def __eq__(self, other):
        if isinstance(other, MegatronObject):
            return (self.megatron_class, self.args, self.state) == (other.megatron_class, other.args, other.state)
        return self.state is None and self.value == other

    def __hash__(self):
        return hash((self.megatron_class, repr(self.args)))

    def __repr__(self):
        return f"{self.megatron_class}({', '.join(map(repr, self.args))})"


_STAND_INS: dict[str, type] = {}  # every Megatron class met so far (the next file needs no retries)


def stand_in(full_name: str) -> type:
    """The stand-in class for the Megatron class `full_name` (module.qualname)."""
    if full_name not in _STAND_INS:
        module, _, name = full_name.rpartition(".")
        _STAND_INS[full_name] = type(name, (MegatronObject,), {"__module__": module, "__qualname__": name,
                                                               "megatron_class": full_name})
    return _STAND_INS[full_name]


def _plain_classes(torch) -> list:
    """Classes (or (class, name) pairs) a Megatron file may hold besides tensors, none of which runs code of
    the file's choosing: both spellings of numpy's reconstructors (numpy 1's numpy.core, numpy 2's
    numpy._core), whichever numpy wrote the file."""
    out: list = [argparse.Namespace, types.SimpleNamespace, signal.Signals, pathlib.PosixPath, io.BytesIO,
                 np.ndarray, np.dtype, torch.Generator]
    out += [t for t in vars(np.dtypes).values() if isinstance(t, type) and issubclass(t, np.dtype)]
    multiarray = (np._core if hasattr(np, "_core") else np.core).multiarray
    for module in ("numpy.core.multiarray", "numpy._core.multiarray"):
        out += [(multiarray._reconstruct, f"{module}._reconstruct"), (multiarray.scalar, f"{module}.scalar")]
    return out


class _TrustingUnpickler(pickle.Unpickler):
    """Python's full unpickler (for --trust-checkpoint), with Megatron's classes still as stand-ins: a file
    written by one Megatron release names classes another lacks, and none is worth importing Megatron for."""

    def find_class(self, module, name):
        if module.startswith(MEGATRON) or module == MEGATRON[:-1]:
            return stand_in(f"{module}.{name}")
        return super().find_class(module, name)


_trusting_pickle = types.SimpleNamespace(Unpickler=_TrustingUnpickler, load=lambda f, **kw: _TrustingUnpickler(f, **kw).load(),
                                         __name__="megajax_trusting_pickle")


def _torch():
    try:
        import torch
    except ImportError:
        raise CheckpointError("Megatron checkpoints need PyTorch: pip install 'megajax[torch]'.") from None
    return torch


def load(source, trust: bool = False, name: str | None = None):
    """torch.load of a Megatron file: a path (memory-mapped when it is a zip archive) or an open file
    (`name` says what it is in messages); weights-only with Megatron's classes as stand-ins, unless
    `trust`. CheckpointError naming the file and what it refused."""
    torch = _torch()
    kwargs = dict(map_location="cpu", mmap=isinstance(source, Path) and zipfile.is_zipfile(source))
    where = str(source) if name is None else name
    try:
        if trust:
            return torch.load(source, weights_only=False, pickle_module=_trusting_pickle, **kwargs)
        plain = _plain_classes(torch)
        for _ in range(_MAX_STAND_INS):
            try:
                allowed = plain + [(cls, full) for full, cls in _STAND_INS.items()]
                with torch.serialization.safe_globals(allowed):
                    if not isinstance(source, Path):
                        source.seek(0)
                    return torch.load(source, weights_only=True, **kwargs)
            except pickle.UnpicklingError as e:
                blocked = re.search(r"GLOBAL ([\w.]+)", str(e))
                if blocked is None or not blocked.group(1).startswith(MEGATRON) or blocked.group(1) in _STAND_INS:
                    raise
                stand_in(blocked.group(1))  # and read the file again
        raise CheckpointError(f"Megatron checkpoint file {where!r} names more than {_MAX_STAND_INS} Megatron "
                              f"classes; {TRUST_HINT}.")
    except pickle.UnpicklingError as e:
        blocked = re.search(r"GLOBAL ([\w.]+)", str(e))
        if blocked is None:
            detail = re.search(r"WeightsUnpickler error:\s*(.+)", str(e))
            raise CheckpointError(f"{where!r} is not a readable torch checkpoint file"
                                  f"{f' ({detail.group(1).strip()})' if detail else ''}; {TRUST_HINT}.") from None
        raise CheckpointError(f"Megatron checkpoint file {where!r} holds a Python object of {blocked.group(1)}, "
                              f"which is neither Megatron's nor one of PyTorch's checkpoint classes, so megajax "
                              f"does not unpickle it; {TRUST_HINT}.") from None
    except CheckpointError:
        raise
    except Exception as e:  # noqa: BLE001 - torch raises many kinds for a bad file
        raise CheckpointError(f"cannot read Megatron checkpoint file {where!r}: "
                              f"{str(e).strip().splitlines()[0]}") from None
