"""Audit one checkpoint against a policy: is it quantized the way we said it would be?

Every rule but `no-nan` reads the header only (plus the few bytes of metadata tensors that
detection reads anyway). The rules, each a stable name in the findings:

    expect-scheme          every quantized weight, and every selected weight, has this scheme.
                           Selected: what --require-quantized matches, else the linear weights
                           `qtool quantize` would pick by default (GGUF names are read through
                           the LLaMA name map). A plain selected weight is a finding unless
                           --allow-plain matches it.
    require-quantized      every weight a pattern matches is quantized, unless --allow-plain
                           matches it too
    max-bits-per-weight    all stored bytes * 8 / all parameters, as `qtool inspect` reports it
                           (4 decimals), is at most X
    fail-on-unknown        no weight of a type qtool cannot classify, and no weight with a note
    targeted-but-plain     coverage: a linear weight the checkpoint's compressed-tensors
                           `quantization_config` targets is stored plain
    ignored-but-quantized  coverage: a weight is quantized although `ignore` lists its module
                           (`re:` entries are re.match, others exact names, as in compressed-tensors)
    missing-member         coverage: a targeted weight lacks a member its layout needs (a scale,
                           a zero point for an asymmetric group, compressed-tensors' weight_shape)
    no-nan                 streams every weight, dequantized first, and finds no NaN or Inf

A config target that is a class name (`Linear`) can't be resolved from a header, so for the
coverage audit it covers the weights that look linear: 2-D `*.weight` outside embeddings,
norms and `lm_head`, as `qtool quantize` selects them.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any
from collections.abc import Callable

from qtool.error_measures import count_non_finite
from qtool.errors import CheckpointError, QtoolError, UsageError, ViolationError
from qtool.formats.checkpoint import Checkpoint
from qtool.message_text import counted, excerpt, shorten
from qtool.model_summary import describe_model
from qtool.naming import gguf_to_hf
from qtool.patterns import compile_pattern, matches_any
from qtool.scheme import QScheme
from qtool.selection import FLOAT_DTYPES, default_selects, parse_scheme_option
from qtool.weight import Weight
from qtool.weight_position import weight_position

__all__ = ["SCHEMA_VERSION", "RULES", "CheckRules", "Finding", "Audit", "audit", "scheme_matches"]

SCHEMA_VERSION = 1
RULES = (
    "expect-scheme",
    "require-quantized",
    "max-bits-per-weight",
    "fail-on-unknown",
    "targeted-but-plain",
    "ignored-but-quantized",
    "missing-member",
    "no-nan",
)
# compressed-tensors leaves that only a quantized module has
_QUANT_LEAVES = {
    "weight_scale": "scale",
    "weight_zero_point": "zero_point",
    "weight_global_scale": "global_scale",
    "weight_shape": "shape",
}


@dataclass(frozen=True)
class CheckRules:
    """What `qtool check` enforces. Patterns are globs, or `re:` regexes anchored at the start."""

    expect_scheme: str | None = None
    require_quantized: tuple[str, ...] = ()
    allow_plain: tuple[str, ...] = ()
    max_bits_per_weight: float | None = None
    fail_on_unknown: bool = False
    no_nan: bool = False
    coverage: bool = True

    def validate(self) -> None:
        """Bad schemes and regexes fail here, before anything is read (exit 2)."""
        if self.expect_scheme is not None:
            parse_scheme_option(self.expect_scheme, "expect-scheme")
        for pattern in (*self.require_quantized, *self.allow_plain):
            compile_pattern(pattern)

    def to_json(self) -> dict[str, Any]:
        """The rules with their thresholds, as `check --json` reports them (`policy`)."""
        return {key: list(value) if isinstance(value, tuple) else value for key, value in asdict(self).items()}


@dataclass(frozen=True)
class Finding:
    rule: str
    weight: str | None  # None for a finding about the whole checkpoint
    detail: str

    def to_json(self) -> dict[str, str | None]:
        return {"rule": self.rule, "weight": self.weight, "detail": self.detail}

    def line(self) -> str:
        return f"{self.rule}: {self.weight + ': ' if self.weight else ''}{self.detail}"


@dataclass
class Audit:
    path: str
    weights: int
    rules: list[str]  # the rules that were applied
    findings: list[Finding] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)  # how the checkpoint was found (Checkpoint.notes)
    # added for issue 23 (the HTML report): the rules' thresholds, the checkpoint's format and weights
    policy: dict[str, Any] = field(default_factory=dict)
    container: str = ""
    listed: list[Weight] = field(default_factory=list, repr=False)

    @property
    def ok(self) -> bool:
        return not self.findings

    def to_json(self, *, weight_rows: bool = True) -> dict[str, Any]:
        """The `check --json` document. `weight_rows` False leaves out the per-weight rows (and
        the model summary), which cost time on a header of a million tensors and which only the
        JSON and HTML outputs show."""
        document = {
            "schema_version": SCHEMA_VERSION,
            "path": self.path,
            "ok": self.ok,
            "rules": list(self.rules),
            "weights": self.weights,
            "findings": [f.to_json() for f in self.findings],
            "policy": self.policy,
        }
        if weight_rows:
            document["model"] = describe_model(
                self.path,
                self.container,
                ((w.scheme.label if w.scheme else None, w.parameters, w.nbytes) for w in self.listed),
            )
            document["weight_rows"] = [_row(weight) for weight in self.listed]
        return document

    def raise_for_findings(self) -> None:
        if self.findings:
            counts: dict[str, int] = {}
            for finding in self.findings:
                counts[finding.rule] = counts.get(finding.rule, 0) + 1
            summary = ", ".join(f"{rule} ×{n}" for rule, n in counts.items())
            raise ViolationError(
                f"{counted(len(self.findings), 'finding')} {'breaks' if len(self.findings) == 1 else 'break'} the policy ({summary})",
                reasons=[f.line() for f in self.findings],
                hint="the findings are listed on stdout, and as data in the JSON document",
                path=self.path,
            )


def _row(weight: Weight) -> dict[str, Any]:
    return {
        "name": weight.name,
        "shape": list(weight.shape),
        "dtype": weight.dtype,
        "scheme": weight.scheme.label if weight.scheme else None,
        "parameters": weight.parameters,
        "bytes": weight.nbytes,
        "bits_per_weight": round(weight.bits_per_weight, 4),
        **weight_position(weight.name).to_json(),
    }


def scheme_matches(expected: QScheme, actual: QScheme, shape: tuple[int, ...]) -> bool:
    """Same values, same blocks for this weight, same symmetry, same scale family; the layout
    (convention, packing, scale storage dtype) may differ. A rule (llama.cpp's Q4_K, ...) must
    be that rule."""
    if expected.family != actual.family or expected.qtype.name != actual.qtype.name:
        return False
    if expected.qtype.kind == "int" and expected.symmetric != actual.symmetric:
        return False
    if expected.block_for(shape) != actual.block_for(shape):
        return False
    return expected.rule is None or actual.rule == expected.rule


def _looks_linear(weight: Weight, name: str) -> bool:
    """What `qtool quantize` selects by default: a 2-D float (or quantized) linear *.weight."""
    return len(weight.shape) == 2 and default_selects(name) and (weight.quantized or weight.dtype in FLOAT_DTYPES)


def audit(
    checkpoint: Checkpoint,
    weights: list[Weight],
    rules: CheckRules,
    *,
    device: str = "cpu",
    on_progress: Callable[[int], None] | None = None,
) -> Audit:
    rules.validate()
    applied: list[str] = []
    findings: list[Finding] = []
    logical = (lambda name: gguf_to_hf(name)) if checkpoint.format == "gguf" else (lambda name: name)
    allow = [compile_pattern(p) for p in rules.allow_plain]
    require = [(p, compile_pattern(p)) for p in rules.require_quantized]
    expected = parse_scheme_option(rules.expect_scheme, "expect-scheme") if rules.expect_scheme else None
    _refuse_unmatched(checkpoint, weights, require)
    notes = [
        f"allow-plain pattern '{excerpt(p)}' matches no weight"
        for p, match in zip(rules.allow_plain, allow)
        if not any(match(w.name) for w in weights)
    ]
    if require:
        applied.append("require-quantized")
    if expected is not None:
        applied.append("expect-scheme")
    for weight in weights:
        allowed_plain = matches_any(weight.name, allow)
        required_by = next((p for p, match in require if match(weight.name)), None)
        if required_by is not None and not weight.quantized and not allowed_plain:
            findings.append(
                Finding(
                    "require-quantized",
                    weight.name,
                    f"stored plain ({weight.dtype}), but --require-quantized '{required_by}' matches it",
                )
            )
            continue
        if expected is None:
            continue
        if weight.quantized:
            scheme = weight.require_scheme()
            if not scheme_matches(expected, scheme, weight.shape):
                findings.append(Finding("expect-scheme", weight.name, f"{scheme.label}, expected {expected.label}"))
            continue
        selected = required_by is not None if require else _looks_linear(weight, logical(weight.name))
        if selected and not allowed_plain:
            findings.append(
                Finding("expect-scheme", weight.name, f"stored plain ({weight.dtype}), expected {expected.label}")
            )

    if rules.max_bits_per_weight is not None:
        applied.append("max-bits-per-weight")
        parameters = sum(w.parameters for w in weights)
        total = sum(t.nbytes for t in checkpoint.tensors.values())
        bits = round(total * 8 / parameters, 4) if parameters else 0.0
        if bits > rules.max_bits_per_weight:
            detail = f"{bits:.4f} bits per weight, more than {rules.max_bits_per_weight:g}{_plain_cost(weights, total)}"
            findings.append(Finding("max-bits-per-weight", None, detail))

    if rules.fail_on_unknown:
        applied.append("fail-on-unknown")
        for weight in weights:
            if weight.scheme is not None and weight.scheme.qtype.kind == "unknown":
                findings.append(
                    Finding(
                        "fail-on-unknown", weight.name, f"qtool cannot classify its type {weight.scheme.qtype.name}"
                    )
                )
            for note in weight.notes:
                findings.append(Finding("fail-on-unknown", weight.name, note))

    if rules.coverage:
        coverage = _coverage(checkpoint, weights, allow, logical)
        if coverage is not None:
            applied.extend(("targeted-but-plain", "ignored-but-quantized", "missing-member"))
            findings.extend(coverage)

    if rules.no_nan:
        applied.append("no-nan")
        findings.extend(_no_nan(checkpoint, weights, device, on_progress))
    return Audit(
        checkpoint.path,
        len(weights),
        applied,
        findings,
        notes,
        policy=rules.to_json(),
        container=checkpoint.format,
        listed=weights,
    )


PLAIN_NAMED = 3  # the largest plain weights a max-bits-per-weight finding names


def _plain_cost(weights: list[Weight], total: int) -> str:
    """What the plain weights cost, for a max-bits-per-weight finding: their share of the bytes
    and the largest few with theirs (on a small model, the embeddings and head kept plain are
    most of the file). Empty when every weight is quantized."""
    import heapq

    plain = [w for w in weights if not w.quantized]
    if not plain or total <= 0:
        return ""
    largest = heapq.nlargest(PLAIN_NAMED, plain, key=lambda w: w.nbytes)  # linear in the weights
    named = ", ".join(f"{shorten(w.name)} ({100 * w.nbytes / total:.0f}%)" for w in largest)
    return f"; plain weights hold {100 * sum(w.nbytes for w in plain) / total:.0f}% of the bytes, the largest {named}"


def _refuse_unmatched(
    checkpoint: Checkpoint, weights: list[Weight], require: list[tuple[str, Callable[[str], bool]]]
) -> None:
    """A gate whose pattern matches no weight checks nothing: a typo in a CI policy would pass
    every model, so it is a usage error naming the pattern, before anything is read."""
    for pattern, match in require:
        if not any(match(weight.name) for weight in weights):
            raise UsageError(
                f"require-quantized pattern '{excerpt(pattern)}' matches no weight",
                hint="patterns match weight names as `qtool inspect` lists them: a glob the whole name, re: a regex anchored at the start",
                path=checkpoint.path,
                option="require_quantized",
            )


def _coverage(checkpoint: Checkpoint, weights: list[Weight], allow, logical) -> list[Finding] | None:
    """Findings of the coverage audit, or None when the checkpoint has no compressed-tensors
    quantization_config to audit against."""
    from qtool.conventions.base import by_module
    from qtool.conventions.compressed_tensors import config_rules

    config = config_rules(checkpoint)
    if not config.config:
        return None
    owners = {member.name: weight for weight in weights for member in weight.members.values()}
    findings = []
    for module, leaves in by_module(dict(checkpoint.tensors)).items():
        name = f"{module}.weight" if module else "weight"
        data_leaf = "weight_packed" if "weight_packed" in leaves else "weight" if "weight" in leaves else None
        owner = owners.get(leaves[data_leaf].name) if data_leaf else None
        quant_leaves = sorted(leaf for leaf in leaves if leaf in _QUANT_LEAVES)
        entry = config.ignored_by(module)
        if entry is not None:
            if owner is not None and owner.quantized:
                findings.append(
                    Finding(
                        "ignored-but-quantized",
                        owner.name,
                        f"{owner.require_scheme().label}, but the config's ignore entry '{entry}' lists {module}",
                    )
                )
            continue
        found = config.group_for(module)
        if found is None:
            continue
        target = found[0]
        if data_leaf is None:
            if quant_leaves:
                findings.append(
                    Finding(
                        "missing-member",
                        name,
                        f"has {', '.join(quant_leaves)} but no weight_packed or weight (targeted by '{target}')",
                    )
                )
            continue
        if owner is None:
            continue
        by_class = not target.startswith("re:") and target != module
        if by_class and not (quant_leaves or data_leaf == "weight_packed" or _looks_linear(owner, logical(name))):
            continue
        if owner.quantized:
            missing = _missing_members(config.args_for(module), owner)
            if missing:
                findings.append(
                    Finding(
                        "missing-member",
                        owner.name,
                        f"{owner.scheme.label if owner.scheme else ''} without {', '.join(missing)}, which the config's group targeting it ('{target}') needs",
                    )
                )
        elif (
            quant_leaves
            or data_leaf == "weight_packed"
            or owner.data.dtype.name in ("I8", "I32", "U8")
            or owner.data.dtype.name.startswith("F8_")
        ):
            if "weight_scale" not in leaves:
                detail = f"{data_leaf} is stored ({owner.data.dtype.name}) but weight_scale is missing"
            else:
                detail = "; ".join(owner.notes) or f"{data_leaf} and its members do not form a quantized weight"
            findings.append(Finding("missing-member", name, f"{detail} (targeted by '{target}')"))
        elif not matches_any(owner.name, allow) and len(owner.shape) == 2 and owner.dtype in FLOAT_DTYPES:
            findings.append(
                Finding(
                    "targeted-but-plain",
                    owner.name,
                    f"stored plain ({owner.dtype}), but the config's group targets it ('{target}')",
                )
            )
    return findings


def _missing_members(args, weight: Weight) -> list[str]:
    missing = []
    if (
        args is not None
        and args.symmetric is False
        and (args.type or "int") == "int"
        and "zero_point" not in weight.members
    ):
        missing.append("weight_zero_point")
    if weight.data.name.endswith("weight_packed") and weight.data.dtype.name == "I32" and "shape" not in weight.members:
        missing.append("weight_shape")
    if args is not None and args.strategy == "tensor_group" and "global_scale" not in weight.members:
        missing.append("weight_global_scale")
    return missing


def _no_nan(checkpoint: Checkpoint, weights: list[Weight], device: str, on_progress) -> list[Finding]:
    """Plain weights are read with numpy (`qtool.value_stats`), no torch; quantized ones are decoded
    by their convention first, in torch where that decoder is torch's."""
    from qtool.value_stats import count_stored_non_finite

    findings = []
    for weight in weights:
        values = None
        try:
            counts = None
            if weight.quantized:
                from qtool.conventions import decoder_for

                values = decoder_for(weight).decode(checkpoint, weight, device)
                counts = count_non_finite(values)
            else:
                counts = count_stored_non_finite(checkpoint, weight)
            if counts is not None:
                nan, inf = counts
                if nan or inf:
                    where = "after dequantizing" if weight.quantized else "stored"
                    findings.append(Finding("no-nan", weight.name, f"{nan} NaN and {inf} Inf values ({where})"))
        except CheckpointError:  # the file itself can't be read (truncated meanwhile): exit 2
            raise
        except QtoolError as exc:  # fail closed: a weight that can't be decoded can't be cleared
            findings.append(Finding("no-nan", weight.name, f"cannot be decoded to check it: {exc}"))
        finally:
            del values
            for member in weight.members.values():
                checkpoint.release(member)
        if on_progress:
            on_progress(weight.nbytes)
    return findings
