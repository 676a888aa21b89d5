"""The session code outside argv: written 0600, read from a prompt, stdin or a file.

A code on a command line is in every local user's `ps` output and in shell history; so
`kafila host --code-file F` writes F readable by its owner only, and `kafila join -` (or
`--code-file F`, `F` being `-` for stdin) reads the code without it ever being an argument.
"""

from __future__ import annotations

import getpass
import os
import stat
import sys

from backends.errors import BadInput

MAX_CODE_CHARS = 200


def write_private(path: str, text: str) -> None:
    """Write text to path, readable and writable by its owner only (0600), even if it existed."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.fchmod(fd, 0o600)  # an existing file keeps its mode through O_CREAT
        os.write(fd, text.encode())
    finally:
        os.close(fd)


def read_code(source: str | None, *, stdin=None, prompt=getpass.getpass) -> str:
    """The code from a file path, from stdin (`-` or None without a terminal), or a prompt."""
    stdin = stdin if stdin is not None else sys.stdin
    if source not in (None, "-"):
        try:
            mode = os.stat(source).st_mode
            with open(source) as f:
                text = f.read(MAX_CODE_CHARS + 1)
        except OSError as exc:
            raise BadInput(f"cannot read the code from {source}: {exc.strerror or exc}") from None
        if mode & (stat.S_IRGRP | stat.S_IROTH):
            print(f"warning: {source} is readable by other users; chmod 600 it", file=sys.stderr)
    elif stdin is not None and stdin.isatty():
        text = prompt("session code (not echoed): ")
    else:
        text = (stdin.readline(MAX_CODE_CHARS + 1) if stdin is not None else "")
    text = text.strip()
    if not text or len(text) > MAX_CODE_CHARS:
        raise BadInput("no session code given: type it, pipe it on stdin, or use --code-file F")
    return text
