"""The exceptions Sparrow raises; each carries the message the `sparrow`
command prints after "error: "."""


class SparrowError(Exception):
    """Base class of every Sparrow error."""


class ConfigError(SparrowError, ValueError):
    """A config key or value that cannot be right (names the key)."""


class DataError(SparrowError, ValueError):
    """Malformed or mismatched data (names the file, line or column)."""


class CheckpointError(SparrowError):
    """A checkpoint or export that is missing, damaged or of another model."""


class FileError(SparrowError, OSError):
    """A file that cannot be read or written (names it)."""


class DivergedError(SparrowError, ArithmeticError):
    """Training met a non-finite loss, gradient or weight."""


class ArgumentError(SparrowError, ValueError):
    """An argument that cannot be right."""
