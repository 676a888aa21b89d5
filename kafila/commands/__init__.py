"""One module per `kafila` subcommand.

Each module defines `register(subparsers)`, which adds its parser and sets `handler` to a
function taking the parsed namespace and returning an exit code. Only these modules parse
arguments; the rest of the code takes dataclasses.
"""

COMMANDS = (
    "run",
    "serve",
    "models",
    "inspect",
    "bench",
    "probe",
    "plan",
    "netcheck",
    "rendezvous",
    "host",
    "join",
    "chat",
    "status",
    "demo",
    "tokenize",
)
