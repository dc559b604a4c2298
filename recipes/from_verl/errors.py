"""What a translation that cannot go on raises: every problem found, one line each."""

from __future__ import annotations


class VerlTranslationError(ValueError):
    """A verl launch lorarl cannot translate. `problems` holds one line per problem, each naming
    the key or file and what to do; str() joins them with newlines."""

    def __init__(self, *problems: str):
        self.problems = list(problems)
        super().__init__("\n".join(self.problems))


class Problems:
    """The problems of one launch, found in one pass and reported by weight: `decisive` first
    (lorarl cannot train the launch whatever else changes: full fine-tuning, an estimator or a
    reward lorarl lacks, a critic, a model without a preset), then each key's own (`append`),
    then `foreign`, the one line naming the keys no verl release has."""

    def __init__(self) -> None:
        self.decisive: list[str] = []
        self.keys: list[str] = []
        self.foreign: str | None = None

    def append(self, line: str) -> None:
        self.keys.append(line)

    def extend(self, lines: list[str]) -> None:
        self.keys.extend(lines)

    def lines(self) -> list[str]:
        return self.decisive + self.keys + ([self.foreign] if self.foreign else [])

    def __bool__(self) -> bool:
        return bool(self.lines())

    def raise_any(self) -> None:
        if self:
            raise VerlTranslationError(*self.lines())
