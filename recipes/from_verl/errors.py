"""What a translation that cannot go on raises: every problem found, one line each."""

from __future__ import annotations


class VerlTranslationError(ValueError):
    """A verl launch lorarl cannot translate. `problems` holds one line per problem, each naming
    the key or file and what to do; str() joins them with newlines."""

    def __init__(self, *problems: str):
        self.problems = list(problems)
        super().__init__("\n".join(self.problems))
