"""Model code: names logical axes only, never mesh axes."""

from megajax.models.transformer import Transformer, param_axes

__all__ = ["Transformer", "param_axes"]
