"""`qtool-policy.toml`: the rules of `qtool check` and the gates of `qtool compare` in one file,
so CI configs stay short. Keys are spelled as the command-line options:

    [check]
    expect-scheme = "W4A16"
    require-quantized = ["re:.*\\\\.mlp\\\\.experts\\\\..*"]
    allow-plain = ["re:.*\\\\.mlp\\\\.gate\\\\.weight"]
    max-bits-per-weight = 5.0
    fail-on-unknown = true
    no-nan = false
    coverage = true

    [compare]
    min-sqnr = 15.0
    max-rel-rmse = 0.2
    max-missing = 0
    map = ['re:^blk\\.(\\d+)\\.=model.layers.\\1.']

Options given on the command line add to the file: patterns and maps are appended, a number
given there replaces the file's, and a flag can turn a rule on but not off. An unknown section
or key, or a value of the wrong type, is a usage error (exit 2) naming it.
"""

from __future__ import annotations

import difflib
import os
import sys
from dataclasses import dataclass, field, replace
from typing import Any

from qtool.audit import CheckRules
from qtool.comparison import Gates
from qtool.errors import UsageError
from qtool.formats.regular_files import NotReadable, read_regular

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

__all__ = ["Policy", "load_policy"]

_CHECK_KEYS = {
    "expect-scheme": str,
    "require-quantized": list,
    "allow-plain": list,
    "max-bits-per-weight": float,
    "fail-on-unknown": bool,
    "no-nan": bool,
    "coverage": bool,
}
_COMPARE_KEYS = {"min-sqnr": float, "max-rel-rmse": float, "max-missing": int, "map": list}
_SECTIONS = {"check": _CHECK_KEYS, "compare": _COMPARE_KEYS}
MAX_POLICY_BYTES = 1 << 20  # a policy is a few lines; more is not a policy


@dataclass(frozen=True)
class Policy:
    check: CheckRules = field(default_factory=CheckRules)
    gates: Gates = field(default_factory=Gates)
    maps: tuple[str, ...] = ()

    def with_check_options(
        self,
        *,
        expect_scheme: str | None = None,
        require_quantized: tuple[str, ...] = (),
        allow_plain: tuple[str, ...] = (),
        max_bits_per_weight: float | None = None,
        fail_on_unknown: bool = False,
        no_nan: bool = False,
    ) -> Policy:
        rules = self.check
        return replace(
            self,
            check=CheckRules(
                expect_scheme=expect_scheme if expect_scheme is not None else rules.expect_scheme,
                require_quantized=(*rules.require_quantized, *require_quantized),
                allow_plain=(*rules.allow_plain, *allow_plain),
                max_bits_per_weight=max_bits_per_weight
                if max_bits_per_weight is not None
                else rules.max_bits_per_weight,
                fail_on_unknown=rules.fail_on_unknown or fail_on_unknown,
                no_nan=rules.no_nan or no_nan,
                coverage=rules.coverage,
            ),
        )

    def with_compare_options(
        self,
        *,
        min_sqnr: float | None = None,
        max_rel_rmse: float | None = None,
        max_missing: int | None = None,
        maps: tuple[str, ...] = (),
    ) -> Policy:
        gates = self.gates
        return replace(
            self,
            gates=Gates(
                min_sqnr=min_sqnr if min_sqnr is not None else gates.min_sqnr,
                max_rel_rmse=max_rel_rmse if max_rel_rmse is not None else gates.max_rel_rmse,
                max_missing=max_missing if max_missing is not None else gates.max_missing,
            ),
            maps=(*self.maps, *maps),
        )


def load_policy(path: str | os.PathLike[str] | None) -> Policy:
    """The policy in a TOML file; an empty policy for None."""
    if path is None:
        return Policy()
    where = os.fspath(path)
    try:
        raw = read_regular(where, MAX_POLICY_BYTES)  # a FIFO is never waited on, /dev/zero never read
    except NotReadable as exc:
        raise UsageError(f"cannot read the policy file: {exc}", path=where) from None
    except OSError as exc:
        raise UsageError(f"cannot read the policy file: {exc.strerror or exc}", path=where) from None
    if len(raw) > MAX_POLICY_BYTES:
        raise UsageError(
            f"the policy file is larger than {MAX_POLICY_BYTES} bytes",
            path=where,
            hint="see README, 'qtool-policy.toml'",
        )
    try:
        document = tomllib.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as exc:
        raise UsageError(f"the policy file is not UTF-8 text (byte {exc.start})", path=where) from None
    except tomllib.TOMLDecodeError as exc:
        raise UsageError(
            f"the policy file is not valid TOML: {exc}", path=where, hint="see README, 'qtool-policy.toml'"
        ) from None
    values: dict[str, dict[str, Any]] = {}
    for section, table in document.items():
        keys = _SECTIONS.get(section)
        if keys is None or not isinstance(table, dict):
            raise _unknown(
                where,
                f"section [{section}]" if keys is None else f"{section} (not a [section])",
                section,
                list(_SECTIONS),
            )
        values[section] = {}
        for key, value in table.items():
            kind = keys.get(key)
            if kind is None:
                raise _unknown(where, f"key {key!r} in [{section}]", key, list(keys))
            values[section][key] = _typed(where, section, key, value, kind)
    check, compare = values.get("check", {}), values.get("compare", {})
    rules = CheckRules(
        expect_scheme=check.get("expect-scheme"),
        require_quantized=tuple(check.get("require-quantized", ())),
        allow_plain=tuple(check.get("allow-plain", ())),
        max_bits_per_weight=check.get("max-bits-per-weight"),
        fail_on_unknown=check.get("fail-on-unknown", False),
        no_nan=check.get("no-nan", False),
        coverage=check.get("coverage", True),
    )
    gates = Gates(compare.get("min-sqnr"), compare.get("max-rel-rmse"), compare.get("max-missing"))
    return Policy(rules, gates, tuple(compare.get("map", ())))


def _typed(where: str, section: str, key: str, value: Any, kind: type) -> Any:
    if kind is float and isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    if kind is int and isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        return value
    if kind is list and isinstance(value, list) and all(isinstance(item, str) for item in value):
        return value
    if kind is list and isinstance(value, str):  # one pattern, written without brackets
        return [value]
    if kind in (str, bool) and type(value) is kind:
        return value
    wanted = {
        float: "a number",
        int: "a whole number ≥ 0",
        list: "a list of strings",
        str: "a string",
        bool: "true or false",
    }[kind]
    raise UsageError(
        f"[{section}] {key} = {value!r} should be {wanted}", path=where, hint="see README, 'qtool-policy.toml'"
    )


def _unknown(where: str, what: str, name: str, valid: list[str]) -> UsageError:
    close = difflib.get_close_matches(name, valid, n=1)
    hint = (f"did you mean {close[0]!r}? " if close else "") + "valid: " + ", ".join(valid)
    return UsageError(f"unknown {what} in the policy file", path=where, hint=hint)
