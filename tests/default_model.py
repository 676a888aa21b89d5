"""The default model for test modules that need its path when they are imported.

Only "not installed" is a skip, with the command that installs it; any other error in resolving
the model is a bug and fails the import (it used to read as "not installed")."""

from __future__ import annotations

import pytest

from backends.errors import BadInput
from kafila.models import resolve_model


def _find() -> tuple[str | None, str]:
    try:
        return resolve_model("smollm2-135m"), ""
    except BadInput as exc:  # the alias's package is missing: the message says how to install it
        return None, f"default model not installed: {exc}"


MODEL, MISSING = _find()
needs_default_model = pytest.mark.skipif(MODEL is None, reason=MISSING or "installed")
