"""What a check of a converted folder says: a Finding (ok, warn or error, with what to do) for each thing it looked
at, and FolderError for a folder that cannot be read at all (or, from `checked`, its first error)."""

from dataclasses import dataclass

from .. import MiniStreamError


class FolderError(MiniStreamError):
    """A folder that cannot be read at all: what is wrong (text) and what to do (fix)."""

    def __init__(self, topic: str, text: str, fix: str):
        super().__init__(f"{text}; {fix}")
        self.topic, self.text, self.fix = topic, text, fix


@dataclass
class Finding:
    """One thing a check found: ok, warn or error, with what to do."""

    level: str  # ok | warn | error
    topic: str
    text: str
    fix: str = ""

    def __str__(self) -> str:
        return f"{self.level:<5} {self.topic}: {self.text}" + (f"; fix: {self.fix}" if self.fix else "")
