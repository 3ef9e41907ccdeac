"""Chroma's `where` and `where_document`, evaluated on one record as Chroma 1.5.9 does.

    {"k": v}  is {"k": {"$eq": v}};  $and / $or take lists of clauses;  `where` AND `where_document`
    $eq        the key is present and equal (int and float compare as numbers; a bool is never a number)
    $ne        the key is absent, of another kind, or not equal
    $gt $gte $lt $lte   numbers only: the key holds a number and the comparison holds
    $in / $nin the value is (is not) one of the list's, of the list's own kind
    $contains / $not_contains   on a list value: it holds (does not hold) the operand
    where_document: $contains / $not_contains (case-sensitive substring), $regex / $not_regex
    (unanchored search; a record without a document is "" for the negations, absent for the others)

`check` bounds and checks a request's filters whole before any record is evaluated. A regex is
Rust's syntax, as Chroma's: RE2's (a flag group in mid-pattern, `(?i)c(?-i)at`, scoped to the end of
its group), matched in linear time. A where that is not Chroma's syntax is a BadWhere (the front's
400).
"""

from __future__ import annotations

from collections.abc import Callable
from functools import lru_cache
from typing import Any

import re2

MAX_DEPTH = 32
MAX_PATTERN = 4096
MAX_NODES = 256  # clauses and operands of one request's where and where_document together
MAX_REGEXES = 16
OPERATORS = frozenset({"$eq", "$ne", "$gt", "$gte", "$lt", "$lte", "$in", "$nin", "$contains",
                       "$not_contains"})
DOCUMENT_OPERATORS = frozenset({"$contains", "$not_contains", "$regex", "$not_regex"})
SCALARS = (str, int, float, bool)


class BadWhere(ValueError):
    """Not a filter Chroma would take: the message says why."""


def _number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _kind(value: object) -> str:
    if isinstance(value, bool):
        return "bool"
    if _number(value):
        return "number"
    return type(value).__name__


def _equal(value: object, operand: object) -> bool:
    return _kind(value) == _kind(operand) and value == operand


def _same(value: object, operand: object) -> bool:
    """$in's equality: of the list's own type (5 is not in [5.0]), as Chroma's typed columns."""
    return type(value) is type(operand) and value == operand


def _clauses(value: object, op: str, what: str) -> list:
    if not isinstance(value, list) or not value:
        raise BadWhere(f"{op} takes a non-empty list of {what} clauses")
    return value


def check(where: object, where_document: object) -> None:
    """BadWhere unless both are Chroma's syntax, within MAX_NODES clauses and operands, MAX_REGEXES
    regexes (each compiled) and MAX_DEPTH levels: a request's filter is checked whole before any
    record is (its cost is then at most records x MAX_NODES)."""
    budget = {"nodes": MAX_NODES, "regexes": MAX_REGEXES}

    def spend(what: str, n: int = 1) -> None:
        budget[what] -= n
        if budget[what] < 0:
            raise BadWhere(f"a filter of more than {MAX_NODES} clauses and values, or {MAX_REGEXES} regexes")

    def document(node: object, depth: int) -> None:
        if depth > MAX_DEPTH or not isinstance(node, dict) or len(node) != 1:
            raise BadWhere("a where_document clause is an object of one operator (at most "
                           f"{MAX_DEPTH} deep)")
        (op, operand), = node.items()
        spend("nodes")
        if op in ("$and", "$or"):
            for sub in _clauses(operand, op, "where_document"):
                document(sub, depth + 1)
        elif op not in DOCUMENT_OPERATORS or not isinstance(operand, str):
            raise BadWhere(f"where_document: {str(op)[:40]!r} is not an operator taking a string")
        elif op in ("$regex", "$not_regex"):
            spend("regexes")
            compiled(operand)

    def clause(node: object, depth: int) -> None:
        if depth > MAX_DEPTH or not isinstance(node, dict) or not node:
            raise BadWhere(f"a where clause is a non-empty object (at most {MAX_DEPTH} deep)")
        for key, condition in node.items():
            spend("nodes")
            if key in ("$and", "$or"):
                for sub in _clauses(condition, key, "where"):
                    clause(sub, depth + 1)
            elif key == "#document":
                document(condition, depth + 1)
            elif not isinstance(key, str) or not key or key.startswith("$"):
                raise BadWhere(f"where: {str(key)[:40]!r} is not a metadata key or $and / $or")
            else:
                field(key, condition)

    def field(key: str, condition: object) -> None:
        if not isinstance(condition, dict):
            condition = {"$eq": condition}
        if len(condition) != 1:
            raise BadWhere(f"Expected operator expression for {key!r} to have exactly one operator")
        (op, operand), = condition.items()
        if op not in OPERATORS:
            raise BadWhere(f"unknown operator {str(op)[:40]!r} for {key!r}")
        if op in ("$in", "$nin"):
            if not (isinstance(operand, list) and operand and all(isinstance(o, SCALARS) for o in operand)):
                raise BadWhere(f"{op} for {key!r} needs a non-empty list of strings, numbers or booleans")
            spend("nodes", len(operand))
        elif op in _ORDER and not _number(operand):
            raise BadWhere(f"{op} for {key!r} needs a number, got {type(operand).__name__}")
        elif not isinstance(operand, SCALARS):
            raise BadWhere(f"{op} for {key!r} needs a string, number or boolean")

    if where:
        clause(where, 0)
    if where_document:
        document(where_document, 0)


_ORDER: dict[str, Callable[[Any, Any], bool]] = {
    "$gt": lambda a, b: a > b, "$gte": lambda a, b: a >= b,
    "$lt": lambda a, b: a < b, "$lte": lambda a, b: a <= b}


def _field(metadata: dict, key: str, condition: object) -> bool:
    if not isinstance(condition, dict):
        condition = {"$eq": condition}
    if len(condition) != 1:
        raise BadWhere(f"Expected operator expression for {key!r} to have exactly one operator")
    (op, operand), = condition.items()
    present = key in metadata and metadata[key] is not None
    value = metadata.get(key)
    if op == "$eq":
        return present and not isinstance(value, list) and _equal(value, operand)
    if op == "$ne":
        return not (present and not isinstance(value, list) and _equal(value, operand))
    if op in _ORDER:
        if not _number(operand):
            raise BadWhere(f"{op} needs a number, got {type(operand).__name__}")
        return present and _number(value) and _ORDER[op](value, operand)
    if op in ("$in", "$nin"):
        if not isinstance(operand, list) or not operand:
            raise BadWhere(f"{op} needs a non-empty list")
        found = present and not isinstance(value, list) and any(_same(value, o) for o in operand)
        return found if op == "$in" else not found
    if op in ("$contains", "$not_contains"):
        held = present and isinstance(value, list) and any(_equal(v, operand) for v in value)
        return held if op == "$contains" else not held
    raise BadWhere(f"unknown operator {str(op)[:40]!r} for {key!r}")


def _clause(node: object, depth: int, what: str) -> bool:
    """Whether `node` has clauses to evaluate (BadWhere if it is not a clause, or too deep)."""
    if not node:
        return False
    if depth > MAX_DEPTH:
        raise BadWhere(f"a {what} nested deeper than {MAX_DEPTH}")
    if not isinstance(node, dict):
        raise BadWhere(f"a {what} is an object")
    return True


def matches(where: dict | None, metadata: dict | None, document: str | None, depth: int = 0) -> bool:
    """Whether a record with `metadata` and `document` passes `where` (which may name `#document`)."""
    if not _clause(where, depth, "where"):
        return True
    assert where is not None
    metadata = metadata or {}
    for key, condition in where.items():
        if key in ("$and", "$or"):
            if not isinstance(condition, list):
                raise BadWhere(f"{key} takes a list of where clauses")
            results = (matches(clause, metadata, document, depth + 1) for clause in condition)
            if not (all(results) if key == "$and" else any(results)):
                return False
        elif key == "#document":
            if not matches_document(condition, document, depth + 1):
                return False
        elif not _field(metadata, key, condition):
            return False
    return True


def matches_document(where_document: dict | None, document: str | None, depth: int = 0) -> bool:
    if not _clause(where_document, depth, "where_document"):
        return True
    assert where_document is not None
    for op, operand in where_document.items():
        if op in ("$and", "$or"):
            if not isinstance(operand, list):
                raise BadWhere(f"{op} takes a list of where_document clauses")
            results = (matches_document(clause, document, depth + 1) for clause in operand)
            if not (all(results) if op == "$and" else any(results)):
                return False
            continue
        if not isinstance(operand, str):
            raise BadWhere(f"{op} in where_document takes a string")
        if op == "$contains":
            found = document is not None and operand in document
        elif op == "$not_contains":
            found = document is None or operand not in document
        elif op == "$regex":
            found = document is not None and compiled(operand).search(document) is not None
        elif op == "$not_regex":
            found = document is None or compiled(operand).search(document) is None
        else:
            raise BadWhere(f"unknown where_document operator {op[:40]!r}")
        if not found:
            return False
    return True


@lru_cache(maxsize=64)
def compiled(pattern: str) -> re2._Regexp:
    """A client's regex, compiled by RE2: Rust's syntax (Chroma's), matched in linear time, its
    memory bounded (RE2's max_mem)."""
    if len(pattern) > MAX_PATTERN:
        raise BadWhere(f"a regex of more than {MAX_PATTERN} characters")
    try:
        return re2.compile(pattern, _OPTIONS)
    except re2.error as exc:
        raise BadWhere(f"invalid regex {pattern[:80]!r}: {exc}") from None


_OPTIONS = re2.Options()
_OPTIONS.log_errors = False  # a client's bad pattern is its 400, not a line in the replica's log
_OPTIONS.max_mem = 1 << 20  # per compiled pattern (RE2's default is 8 MiB): cached ones x this bounded
