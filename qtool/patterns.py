"""Name patterns that users and configs write: a glob, or `re:` followed by a regex.

`re:` patterns are anchored at the start of the name (Python `re.match`), exactly as
compressed-tensors matches its `targets` and `ignore` entries, so the same pattern means the
same thing in a config and on qtool's command line. Globs must match the whole name.

A regex is a program its writer may not know is exponential: `re:.*(a+)+$` or `(a|aa)+$`
against a 40-character name runs for hours in Python's `re` (catastrophic backtracking), and
configs from strangers hold regexes too. So `re:` patterns are compiled with the `regex`
module (re-compatible syntax, safeguards against most such patterns), and every match is bounded
by `MATCH_SECONDS`: a pattern that takes longer on one name is refused (exit 2, naming the
pattern), never left to hang. Globs need no bound: `fnmatch.translate` makes regexes that
cannot backtrack.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable

from qtool.errors import UsageError

__all__ = [
    "compile_pattern",
    "compile_regex",
    "BoundedRegex",
    "matches_any",
    "natural_key",
    "REGEX_PREFIX",
    "MATCH_SECONDS",
    "REGEX_HELP",
]

REGEX_PREFIX = "re:"
MATCH_SECONDS = 0.25  # one name against one regex; a sane pattern takes microseconds
REGEX_HELP = f"a regex match over {MATCH_SECONDS:g} s on one name is refused"  # said in --help


class BoundedRegex:
    """A compiled user or config regex whose `match` is bounded in time.

    `shown` is how the pattern is named when it is refused (`re:...`, or `--map 'OLD=NEW'`)."""

    def __init__(self, source: str, shown: str) -> None:
        import regex  # here: inspect without a regex pattern imports nothing

        self.shown = shown
        self.pattern = regex.compile(source)
        self.groups = self.pattern.groups
        self.groupindex = self.pattern.groupindex

    def match(self, name: str):
        try:
            # positional (string, pos, endpos, concurrent, partial, timeout): a keyword costs
            # a microsecond a call, and a pattern may be matched against 1.6M names
            return self.pattern.match(name, None, None, None, False, MATCH_SECONDS)
        except TimeoutError:
            raise UsageError(
                f"pattern {self.shown} took over {MATCH_SECONDS:g} s on one name ({len(name)} characters): it backtracks catastrophically",
                hint="write a regex without nested repetition, such as (a+)+ or (a|aa)+",
            ) from None


def compile_regex(source: str, shown: str) -> BoundedRegex:
    """`source` compiled as a bounded regex; a bad one raises `ValueError` with the engine's
    reason (callers word the error for their option)."""
    import regex

    try:
        return BoundedRegex(source, shown)
    except (regex.error, re.error, OverflowError, RecursionError) as exc:
        raise ValueError(str(exc)) from None


def compile_pattern(pattern: str) -> Callable[[str], bool]:
    if pattern.startswith(REGEX_PREFIX):
        try:
            bounded = compile_regex(pattern[len(REGEX_PREFIX) :], repr(pattern))
        except ValueError as exc:
            raise UsageError(
                f"invalid regex {pattern!r}: {exc}", hint="write re:<python regex>, e.g. 're:.*\\.mlp\\..*'"
            ) from None
        return lambda name: bounded.match(name) is not None
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
