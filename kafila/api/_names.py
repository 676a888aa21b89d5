"""The names one served model answers to: its id, its alias and its file name. Pure.

A session's engine names its model by the GGUF file's stem (`SmolLM2-135M-Instruct.Q4_1`);
`kafila serve --model smollm2-135m` names it by the alias. Either way the API accepts all three
(`smollm2-135m`, `SmolLM2-135M-Instruct.Q4_1`, `SmolLM2-135M-Instruct.Q4_1.gguf`), because the
alias table (kafila.models.ALIASES) ties an alias to its file name, so every member knows the
alias without being told. Ollama clients add a `:latest` tag to an untagged name; it is ignored.
"""

from __future__ import annotations

from dataclasses import dataclass

GGUF_SUFFIX = ".gguf"
OLLAMA_DEFAULT_TAG = ":latest"


@dataclass(frozen=True)
class ModelNames:
    id: str  # what /v1/models and /api/tags list first
    aliases: tuple[str, ...]  # the other names accepted (alias, file name, stem)

    @property
    def all(self) -> tuple[str, ...]:
        return (self.id, *self.aliases)

    def accepts(self, name: str) -> bool:
        if name in self.all:
            return True
        return name.endswith(OLLAMA_DEFAULT_TAG) and name[: -len(OLLAMA_DEFAULT_TAG)] in self.all

    def served(self) -> str:
        """For error messages: every name, quoted."""
        return ", ".join(repr(n) for n in self.all)


def names_for(model_name: str, aliases: dict | None = None) -> ModelNames:
    """The names of the model an engine calls `model_name` (an alias, a file stem or a file name).

    `aliases` maps alias → an object with `.filename` (kafila.models.ALIASES by default)."""
    if aliases is None:
        from kafila.models import ALIASES

        aliases = ALIASES
    if not model_name:
        return ModelNames("", ())
    if model_name in aliases:
        filename = aliases[model_name].filename
        return ModelNames(model_name, _unique((filename.removesuffix(GGUF_SUFFIX), filename)))
    stem = model_name.removesuffix(GGUF_SUFFIX)
    filename = stem + GGUF_SUFFIX
    known = tuple(a for a, spec in aliases.items() if spec.filename == filename)
    return ModelNames(model_name, _unique((*known, stem, filename), model_name))


def _unique(names: tuple[str, ...], skip: str = "") -> tuple[str, ...]:
    out: list[str] = []
    for n in names:
        if n and n != skip and n not in out:
            out.append(n)
    return tuple(out)
