"""The one user-facing error type: the CLI prints its message on one line and exits non-zero."""


class ShardserveError(Exception):
    """A problem the user can fix (bad input, missing data, corrupt index); never a bug."""
