"""The errors a person sees, each mapped to one exit code (see shared/design/CONTRACTS.md).

Raise these deep; `kafila.cli.main` turns them into one line on stderr and the exit code.
Anything else that escapes is an unexpected failure (exit 1; traceback only with --debug).
"""

EXIT_OK = 0
EXIT_UNEXPECTED = 1
EXIT_BAD_INPUT = 2
EXIT_REFUSED = 3


class KafilaError(Exception):
    """Base of every error meant for a person: the message is one line saying what to do."""

    exit_code = EXIT_UNEXPECTED


class BadInput(KafilaError):
    """Arguments, files, models or JSON that cannot be used (exit 2)."""

    exit_code = EXIT_BAD_INPUT


class Refused(KafilaError):
    """A valid request that cannot be honoured: a plan that does not fit, a session that cannot form (exit 3)."""

    exit_code = EXIT_REFUSED


def describe_error(exc: BaseException) -> str:
    """One line for a person: our own errors' message, anything else's type and message.

    A bare `str(exc)` is empty for TimeoutError() and many others, which left members reading
    "failed: " with nothing after it."""
    if isinstance(exc, KafilaError) and str(exc):
        return str(exc)
    text = str(exc)
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__
