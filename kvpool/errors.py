"""The project's error hierarchy; the server maps these to HTTP codes in one place."""


class KVPoolError(Exception):
    """Base of every error kvpool raises on purpose."""


class ConfigError(KVPoolError, ValueError):
    """A configuration value is out of range or inconsistent."""


class InvalidRequest(KVPoolError, ValueError):
    """A request cannot be served as given (bad parameter, prompt too long, ...)."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class OutOfBlocks(KVPoolError):
    """The pool has too few free blocks for the operation; nothing was changed."""


class UnknownSequence(KVPoolError, KeyError):
    """The sequence id is not allocated (never allocated, or already freed)."""

    def __str__(self) -> str:  # KeyError would repr() the message
        return str(self.args[0]) if self.args else "unknown sequence"


class Overloaded(KVPoolError):
    """The server or cluster refuses new work now; the client may retry later."""

    def __init__(self, message: str, retry_after_s: float = 1.0) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class KVStateError(KVPoolError):
    """An operation does not fit the KV manager's state (double free, sharing a free block, ...)."""
