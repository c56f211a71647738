"""User-facing errors.

Anything the user can fix (a config key, a mesh size, a file) raises a
`UserError`; the CLI prints its message as one paragraph and exits non-zero,
without a traceback.
"""


class UserError(Exception):
    """A mistake the user can fix; the message names the key/file, the bad value and what is accepted."""


class ConfigError(UserError):
    """A bad config key, value or combination."""


class MeshError(UserError):
    """A mesh that does not fit the devices or the model."""


class TrainingError(UserError):
    """Training cannot continue (non-finite loss, ...)."""


class DataError(UserError):
    """A dataset or input file that is missing, corrupt, or does not fit the request."""


class CheckpointError(UserError):
    """A checkpoint (ours, Hugging Face or Megatron) that is missing, malformed, or not representable."""


class DistributedError(UserError):
    """A multi-process run that cannot start or continue (coordinator unreachable, a process died)."""
