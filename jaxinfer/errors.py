"""User-facing errors.

Every error a user can cause (bad model name, corrupt checkpoint, invalid sampling value,
prompt too long) is a ``JaxinferError``. The CLI turns these into one clear line on stderr
and exit code 2; anything else is a bug and keeps its traceback.
"""


class JaxinferError(Exception):
    """Base class for errors caused by user input, reported without a traceback."""


class InvalidRequest(JaxinferError, ValueError):
    """A request or sampling parameter is invalid (names the field and the value)."""


class CheckpointError(JaxinferError):
    """A checkpoint is missing, truncated, corrupt or of an unsupported kind."""


class UnknownModel(JaxinferError):
    """A model name is neither in the registry nor a local path."""
