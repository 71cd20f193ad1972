"""Name patterns that users and configs write: a glob, or `re:` followed by a regex.

`re:` patterns are anchored at the start of the name (Python `re.match`), exactly as
compressed-tensors matches its `targets` and `ignore` entries, so the same pattern means the
same thing in a config and on qtool's command line. Globs must match the whole name.
"""

from __future__ import annotations

import re
from typing import Callable, Iterable

from qtool.errors import UsageError

__all__ = ["compile_pattern", "matches_any", "natural_key", "REGEX_PREFIX"]

REGEX_PREFIX = "re:"


def compile_pattern(pattern: str) -> Callable[[str], bool]:
    if pattern.startswith(REGEX_PREFIX):
        try:
            regex = re.compile(pattern[len(REGEX_PREFIX) :])
        except re.error as exc:
            raise UsageError(f"invalid regex {pattern!r}: {exc}", hint="write re:<python regex>, e.g. 're:.*\\.mlp\\..*'") from None
        return lambda name: regex.match(name) is not None
    import fnmatch  # here: `inspect` without a pattern needs none

    glob = re.compile(fnmatch.translate(pattern))
    return lambda name: glob.match(name) is not None


def matches_any(name: str, patterns: Iterable[Callable[[str], bool]]) -> bool:
    return any(match(name) for match in patterns)


def natural_key(name: str) -> tuple[str | int, ...]:
    """Sort `layers.2` before `layers.10`. Splitting on a group alternates text and digits,
    so equal positions always hold the same type. Runs of digits are cut every 18 digits: a
    name from a file may hold thousands, which int() refuses (and which sort well enough)."""
    parts = _DIGITS.split(name)
    parts[1::2] = map(int, parts[1::2])
    return tuple(parts)


_DIGITS = re.compile(r"([0-9]{1,18})")
