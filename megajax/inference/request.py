"""Request fields as `megajax serve`'s dialects read them: typed values or an error naming the field.

    field(body, name, kind, default, check=, accept=)  -> the value, or RequestError(param=name)
    checked(Sampling, fields)                           -> the settings, or RequestError naming the field
"""

from __future__ import annotations

import json
import secrets

from megajax.inference.sampling import Sampling, SamplingError


class RequestError(Exception):
    """An answer other than 200: `param` names the offending field, `code` OpenAI's error code (or None)."""

    def __init__(self, message: str, param: str | None = None, status: int = 400, code: str | None = None):
        super().__init__(message)
        self.param, self.status, self.code = param, status, code


_MISSING = object()


def field(body: dict, name: str, kind, default=_MISSING, *, check=None, accept: str = ""):
    """body[name] as `kind` (int, float or bool), default when absent or null; RequestError naming the
    field otherwise."""
    value = body.get(name)
    if value is None:
        if default is _MISSING:
            raise RequestError(f"'{name}' is required.", name)
        return default
    ok = {int: lambda v: isinstance(v, int) and not isinstance(v, bool),
          float: lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
          bool: lambda v: isinstance(v, bool)}[kind](value)
    if not ok or (check is not None and not check(value)):
        raise RequestError(f"'{name}' = {json.dumps(value)[:80]}: expected {accept or kind.__name__}.", name)
    return float(value) if kind is float else value


def random_seed() -> int:
    return secrets.randbits(63)


# Each dialect's request field of a Sampling setting (the ranges are megajax.inference.sampling.RANGES).
OPENAI_FIELDS = {"temperature": "temperature", "top_k": "top_k", "top_p": "top_p", "seed": "seed",
                 "presence_penalty": "presence_penalty", "frequency_penalty": "frequency_penalty"}
MEGATRON_FIELDS = {"temperature": "temperature", "top_k": "top_k", "top_p": "top_p", "seed": "random_seed"}


def checked(sampling: Sampling, fields: dict[str, str]) -> Sampling:
    """The sampling settings, or a RequestError naming the request field, its value and the range."""
    try:
        return sampling.check({k: f"'{name}'" for k, name in fields.items()})
    except SamplingError as e:
        raise RequestError(str(e), fields.get(e.field, e.field)) from None
