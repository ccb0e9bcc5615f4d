"""The one exception checkpoint code raises for a checkpoint that cannot be used."""


class CheckpointError(ValueError):
    """A checkpoint is missing, damaged, or does not fit the model; the message is one line."""
