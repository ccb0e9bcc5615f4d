"""The data pipeline's one error class (torch-free: the command line and every data module raise it)."""

from parallel_latent.errors import BadInput


class DataError(BadInput):
    """A data problem; the message is one line naming the offending path."""
