"""Validation of specparity traces: JSON Schema plus cross-record invariants.

Each record is checked against its ``$defs`` entry in ``traces/schema.json``
(Draft 2020-12), then the invariants the schema cannot express are checked
(record order, consecutive indices, window/margins/accept-walk consistency, no
EOS in ``emitted``, footer ``output_ids`` equal to the concatenated emissions).
Every problem is a :class:`ValidationError` naming the line, record type and
field, e.g. ``line 7: round.k_accept: -1 is less than the minimum of 0``.

``validate_main`` implements ``specparity trace validate FILE...``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from functools import cache
from importlib import resources
from typing import Any

from jsonschema import Draft202012Validator
from jsonschema import ValidationError as SchemaError
from jsonschema.exceptions import best_match

from traces.io import RECORD_TYPES, Record, Trace, TraceFormatError, iter_lines, loads_line
from traces.records import MAX_GAMMA

__all__ = [
    "ValidationError",
    "load_schema",
    "validate_file",
    "validate_main",
    "validate_records",
    "validate_trace",
]

TERMINAL_ENDS = frozenset({"eos", "budget", "stop", "grammar"})


@dataclass(frozen=True)
class ValidationError:
    """One problem found in a trace.

    Attributes:
        line: 1-based line number (``None`` for whole-file problems).
        record_type: The record's ``type`` (``None`` if unknown / not a record).
        field: Dotted JSON path including the record type, e.g. ``round.k_accept``
            or ``header.params.gamma``; ``file`` for whole-file problems.
        message: What is wrong.
        path: The file (``"<memory>"`` for in-memory traces).
    """

    line: int | None
    record_type: str | None
    field: str
    message: str
    path: str = "<memory>"

    def __str__(self) -> str:
        where = f"line {self.line}: " if self.line is not None else ""
        return f"{where}{self.field}: {self.message}"

    def format(self) -> str:
        """CLI form ``FILE:LINE: field: message``."""
        loc = f"{self.path}:{self.line}" if self.line is not None else self.path
        return f"{loc}: {self.field}: {self.message}"


@cache
def load_schema() -> dict[str, Any]:
    """The trace JSON Schema (``traces/schema.json``)."""
    text = resources.files("traces").joinpath("schema.json").read_text(encoding="utf-8")
    schema: dict[str, Any] = json.loads(text)
    return schema


@cache
def _validator(rtype: str | None) -> Draft202012Validator:
    """Validator for one record type's ``$defs`` entry (``None``: whole schema)."""
    schema = load_schema()
    if rtype is None:
        return Draft202012Validator(schema)
    sub = {"$defs": schema["$defs"], "$ref": f"#/$defs/{rtype}"}
    return Draft202012Validator(sub)


def _field_path(rtype: str, parts: Iterable[Any]) -> str:
    out = rtype
    for part in parts:
        out += f"[{part}]" if isinstance(part, int) else f".{part}"
    return out


def _schema_errors(path: str, line: int, record: Any) -> list[ValidationError]:
    if not isinstance(record, dict):
        return [ValidationError(line, None, "record", f"expected a JSON object, got {type(record).__name__}", path)]
    rtype = record.get("type")
    if rtype not in RECORD_TYPES:
        msg = f"unknown record type {rtype!r}; expected one of {sorted(RECORD_TYPES)}"
        if "type" not in record:
            msg = "'type' is a required property"
        return [ValidationError(line, None, "record.type", msg, path)]
    errors: list[SchemaError] = sorted(
        _validator(rtype).iter_errors(record), key=lambda e: [str(p) for p in e.absolute_path]
    )
    out: list[ValidationError] = []
    for err in errors:
        # For oneOf/anyOf failures, prefer the most specific sub-error.
        if err.context:
            err = best_match([err, *err.context]) or err
        out.append(ValidationError(line, rtype, _field_path(rtype, err.absolute_path), err.message, path))
    return out


MAX_ERRORS = 200
"""Problems reported per file before the rest are summarised in one line."""


class _Capped(list[ValidationError]):
    """Keeps the first ``cap`` problems and counts the rest (bounded memory on garbage)."""

    def __init__(self, cap: int) -> None:
        super().__init__()
        self.cap, self.dropped = cap, 0

    def append(self, e: ValidationError) -> None:
        if len(self) < self.cap:
            super().append(e)
        else:
            self.dropped += 1

    def extend(self, es: Iterable[ValidationError]) -> None:
        for e in es:
            self.append(e)


def validate_records(
    records: Iterable[tuple[int, Any]], *, path: str = "<memory>", max_errors: int | None = None,
) -> list[ValidationError]:
    """Validate records given with their line numbers, streaming.

    One pass, holding only the header, the footer and the emitted token ids
    (never the records): a trace of any length validates in bounded memory.

    Args:
        records: ``(line_no, record)`` pairs in file order.
        path: Name used in the errors.

    Returns:
        All problems found (empty when the trace is valid); with ``max_errors``,
        at most that many plus one line counting the rest.
    """
    errors: list[ValidationError] = _Capped(max_errors) if max_errors else []
    records = iter(records)
    first = next(records, None)
    if first is not None and isinstance(first[1], dict) and first[1].get("type") == "batch_step":
        # a batch trace (engine.batched): batch_step records only (INTERPRETING.md "Batch traces")
        rest = [first, *records]
        for n, fld, msg in batch_step_problems([r for _, r in rest]):
            errors.append(ValidationError(rest[n - 1][0], "batch_step", fld, msg, path))
        return list(errors)
    records = iter([first, *records] if first is not None else [])

    def err(line: int | None, rtype: str | None, fld: str, msg: str) -> None:
        errors.append(ValidationError(line, rtype, fld, msg, path))

    header: Record | None = None
    footer: Record | None = None
    footer_line: int | None = None
    eos: set[int] = set()
    n_round = n_plain = 0
    seen_event = seen_prefill = seen_header = False
    emitted_all: list[int] = []
    emitted_ok = True  # all events schema-valid, so emitted_all is meaningful
    terminal: tuple[int, str, str] | None = None  # (line, type, end) of a terminal event
    mode: str | None = None
    first_line: int | None = None
    last_line: int | None = None

    for pos, (line, record) in enumerate(records):
        if first_line is None:
            first_line = line
        last_line = line
        schema_errs = _schema_errors(path, line, record)
        errors.extend(schema_errs)
        valid = not schema_errs
        rtype = record.get("type") if isinstance(record, dict) else None
        if rtype not in RECORD_TYPES:
            emitted_ok = False
            continue

        # --- ordering ---------------------------------------------------
        if footer is not None:
            err(line, rtype, rtype, f"record after the footer (footer is on line {footer_line})")
        if rtype == "header":
            seen_header = True
            if pos != 0:
                err(line, rtype, "header", "header must be the first record and appear once")
            elif valid:
                header = record
                eos = set(record["eos_ids"])
                mode = record["mode"]
                gamma = record["params"]["gamma"]
                if gamma is not None and gamma > MAX_GAMMA:
                    err(line, rtype, "header.params.gamma",
                        f"γ {gamma} exceeds the limit of {MAX_GAMMA} (a draft window is γ + 1 tokens)")
            continue
        if pos == 0:
            err(line, rtype, rtype, "first record must be the header")
        if rtype == "prefill":
            if seen_event:
                err(line, rtype, "prefill", "prefill must come before any round/plain record")
            if seen_prefill:
                err(line, rtype, "prefill", "more than one prefill record")
            seen_prefill = True
            continue
        if rtype == "footer":
            if footer is not None:
                err(line, rtype, "footer", "more than one footer record")
            else:
                footer, footer_line = record, line
                if not valid:
                    emitted_ok = False
            continue

        # --- events -------------------------------------------------------
        seen_event = True
        if terminal is not None:
            tl, tt, te = terminal
            err(tl, tt, f"{tt}.end", f"{te!r} ends generation but this is not the last round/plain record")
            terminal = None
        if record.get("end") in TERMINAL_ENDS:
            terminal = (line, rtype, record["end"])
        expected_index = n_round if rtype == "round" else n_plain
        if rtype == "round":
            n_round += 1
        else:
            n_plain += 1
        if not valid:
            emitted_ok = False
            continue
        if record["index"] != expected_index:
            err(line, rtype, f"{rtype}.index", f"expected {expected_index} (indices count from 0 per record type), got {record['index']}")
        if rtype == "round":
            _check_round(line, record, eos, err, _threshold(header))
            if mode == "plain":
                err(line, rtype, "round", "round record in a mode 'plain' trace")
        else:
            _check_plain(line, record, eos, err)
        emitted_all.extend(record["emitted"])

    if first_line is None:
        err(None, None, "file", "empty trace (no records)")
        return errors
    if footer is None:
        err(last_line, None, "footer", "missing footer record (the trace must end with one)")
    if header is None and not seen_header:
        err(first_line, None, "header", "missing header record")

    if footer is not None and emitted_ok and footer_line is not None:
        output = footer["output_ids"]
        if output != emitted_all:
            j = next(
                (i for i, (x, y) in enumerate(zip(output, emitted_all, strict=False)) if x != y),
                min(len(output), len(emitted_all)),
            )
            err(footer_line, "footer", "footer.output_ids",
                f"does not equal the concatenation of all emitted tokens: first difference at "
                f"output token {j} (len {len(output)} vs {len(emitted_all)} emitted)")
        if mode == "plain" and footer["speculation"] is not None:
            err(footer_line, "footer", "footer.speculation", "must be null in a mode 'plain' trace")
    if isinstance(errors, _Capped) and errors.dropped:
        list.append(errors, ValidationError(None, None, "file", f"... and {errors.dropped} more problems", path))
    return list(errors)


def _threshold(header: Any) -> float | None:
    params = header.get("params") if isinstance(header, dict) else None
    t = params.get("confidence_threshold") if isinstance(params, dict) else None
    return float(t) if isinstance(t, int | float) else None


def _check_round(line: int, r: Record, eos: set[int], err: Any, threshold: float | None = None) -> None:
    drafts, window, samples = r["drafts"], r["window"], r["samples"]
    k, emitted, end = r["k_accept"], r["emitted"], r["end"]
    if window[1:] != drafts:
        err(line, "round", "round.window", f"window {window} != [window[0]] + drafts {drafts}")
    if len(r["margins"]) != len(window):
        err(line, "round", "round.margins", f"has {len(r['margins'])} entries, window has {len(window)}")
    if k > len(drafts):
        err(line, "round", "round.k_accept", f"{k} exceeds the number of drafts ({len(drafts)})")
    if len(emitted) > k + 1:
        err(line, "round", "round.emitted", f"{len(emitted)} tokens emitted but at most k_accept + 1 = {k + 1} allowed")
    if len(samples) > len(window):
        err(line, "round", "round.samples", f"{len(samples)} samples for a window of {len(window)}")
    if emitted != samples[: len(emitted)]:
        err(line, "round", "round.emitted", f"{emitted} is not a prefix of samples {samples}")
    for j, tok in enumerate(emitted):
        if tok in eos:
            err(line, "round", f"round.emitted[{j}]", f"EOS id {tok} emitted as content")
    if end == "bonus" and k != len(drafts):
        err(line, "round", "round.end", f"'bonus' requires k_accept == len(drafts) ({k} != {len(drafts)})")
    if end == "correction" and k >= len(drafts):
        err(line, "round", "round.end",
            f"'correction' requires a rejected draft (k_accept {k} < len(drafts) {len(drafts)}); "
            "an all-accepted window (including a zero-length draft) ends with 'bonus'")
    if end == "eos" and not (len(samples) > len(emitted) and samples[len(emitted)] in eos):
        err(line, "round", "round.end", "'eos' requires the sample after the emitted tokens to be an EOS id")
    conf = r["confidence"]
    if conf is not None and len(conf) > len(drafts) + 1:
        err(line, "round", "round.confidence",
            f"{len(conf)} entries for {len(drafts)} drafts (at most one per draft plus the cut position)")
    elif conf is not None and len(conf) == len(drafts) + 1:
        # The extra value is the confidence at the position that cut the block.
        if threshold is None or threshold <= 0:
            err(line, "round", "round.confidence",
                f"{len(conf)} entries for {len(drafts)} drafts, but no positive params.confidence_threshold cut the block")
        elif not conf[-1] < threshold:
            err(line, "round", "round.confidence",
                f"cut-position confidence {conf[-1]} is not below the threshold {threshold}")


def _check_plain(line: int, r: Record, eos: set[int], err: Any) -> None:
    emitted = r["emitted"]
    if r["end"] == "eos" and (r["sample"] not in eos or emitted):
        err(line, "plain", "plain.end", "'eos' requires an EOS sample and nothing emitted")
    if emitted and emitted != [r["sample"]]:
        err(line, "plain", "plain.emitted", f"{emitted} is not [sample] ([{r['sample']}])")
    for j, tok in enumerate(emitted):
        if tok in eos:
            err(line, "plain", f"plain.emitted[{j}]", f"EOS id {tok} emitted as content")


def batch_step_problems(records: Sequence[Any]) -> list[tuple[int, str, str]]:
    """``(ordinal, field, message)`` problems of a batch trace (``batch_step`` records, schema
    ``$defs/batch_step``): each record against the schema, increasing ``index`` values, a row at
    most once per step, each row's rounds counting 0, 1, 2, ... over the steps it ran in."""
    schema = load_schema()
    check = Draft202012Validator({"$defs": schema["$defs"], "$ref": "#/$defs/batch_step"})
    out: list[tuple[int, str, str]] = []
    rounds: dict[str, int] = {}
    last: int | None = None
    for n, rec in enumerate(records, start=1):
        errs = sorted(check.iter_errors(rec), key=lambda e: [str(p) for p in e.absolute_path])
        if errs:
            out += [(n, "batch_step." + (".".join(map(str, e.absolute_path)) or "record"), e.message) for e in errs]
            continue
        if last is not None and rec["index"] <= last:
            out.append((n, "batch_step.index", f"{rec['index']} after {last} (steps increase)"))
        last = rec["index"]
        seen: set[str] = set()
        for e in rec["rows"]:
            if e["row"] in seen:
                out.append((n, "batch_step.rows", f"row {e['row']!r} twice in step {rec['index']}"))
            seen.add(e["row"])
            want = rounds.get(e["row"], 0)
            if e["round"] != want:
                out.append((n, "batch_step.rows", f"row {e['row']!r} round {e['round']}, expected {want}"))
            rounds[e["row"]] = e["round"] + 1
    return out


def validate_batch_steps(records: Sequence[Any]) -> list[str]:
    """:func:`batch_step_problems` as lines (``line N: field: message``); empty: valid."""
    return [f"line {n}: {fld}: {msg}" for n, fld, msg in batch_step_problems(records)]


def validate_trace(trace: Trace) -> list[ValidationError]:
    """Validate an in-memory trace (line numbers are record ordinals, from 1).

    Args:
        trace: The trace.

    Returns:
        All problems found.
    """
    return validate_records(enumerate(trace.records(), start=1), path=trace.path or "<memory>")


def validate_file(path: str | os.PathLike[str], *, max_errors: int = MAX_ERRORS) -> list[ValidationError]:
    """Validate a trace file, streaming, reporting every problem (bad JSON lines included).

    Lines are read with :func:`traces.io.iter_lines` (bounded length, UTF-8,
    regular files only), so ``/dev/zero``, a 50 MB line or a binary file end
    in one clear error instead of a hang or an out-of-memory.

    Args:
        path: The JSONL file.
        max_errors: Problems kept before the rest are counted in one line.

    Returns:
        All problems found (at most ``max_errors`` + 1); an unreadable file
        gives one ``file`` error.
    """
    name = str(path)
    errors: list[ValidationError] = _Capped(max_errors)

    def parsed() -> Iterator[tuple[int, Any]]:
        for line_no, text in iter_lines(path):
            if not text.strip():
                continue
            try:
                yield line_no, loads_line(name, line_no, text)
            except TraceFormatError as exc:
                # Unparsable lines are reported and skipped; the rest is still validated.
                errors.append(ValidationError(line_no, None, "json", exc.message, name))

    try:
        errors.extend(validate_records(parsed(), path=name, max_errors=max_errors))
    except TraceFormatError as exc:
        errors.append(ValidationError(exc.line_no, None, "file", exc.message, name))
    except OSError as exc:
        return [ValidationError(None, None, "file", f"cannot read: {exc.strerror or exc}", name)]
    out = sorted(errors, key=lambda e: (e.line if e.line is not None else 1 << 62))
    if isinstance(errors, _Capped) and errors.dropped:
        out.append(ValidationError(None, None, "file", f"... and {errors.dropped} more problems", name))
    return out


def validate_main(argv: Sequence[str] | None = None) -> int:
    """CLI: ``specparity trace validate FILE...``.

    Prints ``FILE: ok`` or one ``FILE:LINE: field: message`` line per problem.

    Args:
        argv: Arguments after ``trace validate``.

    Returns:
        0 if every file is valid, 1 otherwise, 2 on usage errors.
    """
    parser = argparse.ArgumentParser(
        prog="specparity trace validate", description="Validate specparity JSONL traces."
    )
    parser.add_argument("files", nargs="+", metavar="FILE")
    try:
        args = parser.parse_args(list(argv) if argv is not None else None)
    except SystemExit as exc:
        return int(exc.code or 0) if isinstance(exc.code, int) else 2
    status = 0
    for name in args.files:
        errs = validate_file(name)
        if errs:
            status = 1
            for e in errs:
                print(e.format())
        else:
            print(f"{name}: ok")
    sys.stdout.flush()
    return status
