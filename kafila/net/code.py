"""Session codes: `<nameplate>-<word>-<word>-<word>`, e.g. `7-crossover-clockwork-pandora`.

The nameplate is the lookup id the rendezvous knows; the words (PGP lists, alternating odd,
even, odd as magic-wormhole does, 24 bits) are the password of the SPAKE2 run between host and
member, and never leave the members. The host answers one guess per code (kafila.net.admission);
`kafila host --words 4` gives 32 bits for a session that stays open for long.
"""

from __future__ import annotations

import re
import secrets
from collections.abc import Callable

from backends.errors import BadInput
from kafila.net.words import EVEN_WORDS, ODD_WORDS
from rendezvous.limits import MAX_NAMEPLATE

CODE_WORDS = 3
MAX_CODE_WORDS = 4
_CODE_RE = re.compile(rf"^(\d{{1,6}})((?:-[a-z]+){{{CODE_WORDS},{MAX_CODE_WORDS}}})$")
_ODD, _EVEN = frozenset(ODD_WORDS), frozenset(EVEN_WORDS)


def make_code(nameplate: int, random_bytes: Callable[[int], bytes] = secrets.token_bytes, *,
              words: int = CODE_WORDS) -> str:
    """A fresh code for this nameplate: odd, even, odd (, even) words from random bytes."""
    if not CODE_WORDS <= words <= MAX_CODE_WORDS:
        raise BadInput(f"--words {words}: choose {CODE_WORDS} or {MAX_CODE_WORDS}")
    picks = random_bytes(words)
    words = [(ODD_WORDS if i % 2 == 0 else EVEN_WORDS)[b] for i, b in enumerate(picks)]
    return "-".join([str(nameplate), *words])


def parse_code(code: str) -> tuple[int, str]:
    """A code typed by a person -> (nameplate, normalized code). Raises BadInput with one line."""
    text = code.strip().lower().replace(" ", "-")
    match = _CODE_RE.match(text)
    if match is None:
        raise BadInput(
            f"{code!r} is not a session code: expected NUMBER-WORD-WORD-WORD(-WORD) such as "
            "7-crossover-clockwork-pandora"
        )
    nameplate = int(match.group(1))
    words = match.group(2).split("-")[1:]
    for i, word in enumerate(words):
        if word not in (_ODD if i % 2 == 0 else _EVEN):
            raise BadInput(f"{word!r} in code {code!r} is not a code word: check the spelling")
    if not 1 <= nameplate <= MAX_NAMEPLATE:
        raise BadInput(f"nameplate {nameplate} in {code!r} is out of range 1..{MAX_NAMEPLATE}")
    return nameplate, "-".join([str(nameplate), *words])
