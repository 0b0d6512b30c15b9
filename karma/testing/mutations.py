"""Mutations of a schedule: the edits the fuzzer (fuzz.py) makes to a valid one.

A mutation is a plain tuple (kind, i, j) of two free integers, taken modulo whatever they
index, so that hypothesis (tests/test_fuzz.py) and a seeded random generator (bench/fuzz.py)
draw from the same space and a failing case shrinks to small numbers. Text mutations edit
the YAML as a person would (a decision word, a number, a line deleted, duplicated or moved,
a mapping's keys reordered); operation mutations edit the op list and keep its ids
consistent (an op deleted, duplicated or moved, a dependency dropped or added, a buffer's
alloc or free moved), so that they reach the semantic rules rather than the id checks.
"""

from __future__ import annotations

import re
from dataclasses import replace

from karma.schedule import (
    ACT_CHOICES,
    DTYPES,
    OP_KINDS,
    OPTIM_CHOICES,
    STATUSES,
    STREAMS,
    WEIGHT_CHOICES,
    Op,
    Schedule,
    dump_schedule,
)
from karma.schedule_load import load_schedule

Mutation = tuple[str, int, int]

TEXT_KINDS = ("word", "number", "delete_line", "duplicate_line", "move_line", "reorder_keys")
OP_MUTATION_KINDS = ("delete_op", "duplicate_op", "move_op", "drop_dep", "add_dep",
                     "move_alloc", "move_free")
KINDS = TEXT_KINDS + OP_MUTATION_KINDS

# words of the same family replace each other (a decision, an op kind, a stream, ...)
FAMILIES = (ACT_CHOICES, WEIGHT_CHOICES, OPTIM_CHOICES, OP_KINDS, STREAMS, DTYPES, STATUSES,
            ("cpu", "cuda"))
_WORDS = sorted({w for f in FAMILIES for w in f}, key=len, reverse=True)
_WORD = re.compile(rf"\b({'|'.join(_WORDS)})\b")
# a number: not part of a name ("h.0", "w.3@f", "v100-16g") or of a hex fingerprint
_NUMBER = re.compile(r"(?<![\w.@/-])-?\d+(?:\.\d+)?(?:e[+-]\d+)?(?![\w.@])")
# sections whose numbers change the work a run does: only small edits there, so that a
# mutant never asks for a million micro-batches or a billion-wide layer (a legitimate
# hour-long run, not a hang)
_BOUNDED_SECTIONS = ("config", "model")


def mutated(text: str, schedule: Schedule, mutations: list[Mutation]) -> str:
    """`text` (the YAML of `schedule`) with `mutations` applied in order: operation
    mutations on the schedule (when the text still loads), text mutations on the text."""
    original = text
    for kind, i, j in mutations:
        if kind in TEXT_KINDS:
            text = _TEXT[kind](text, i, j)
            continue
        try:
            s = load_schedule(text) if text != original else schedule
            text = dump_schedule(_OPS[kind](s, i, j))
        except Exception:  # noqa: BLE001 - an earlier edit broke it (judge tells how)
            continue
    return text


def _word(text: str, i: int, j: int) -> str:
    found = list(_WORD.finditer(text))
    if not found:
        return text
    m = found[i % len(found)]
    family = sorted({w for f in FAMILIES if m[1] in f for w in f} - {m[1]})
    return text[:m.start()] + family[j % len(family)] + text[m.end():]


def _number(text: str, i: int, j: int) -> str:
    found = list(_NUMBER.finditer(text))
    m = found[i % len(found)]
    bounded = _section_at(text, m.start()) in _BOUNDED_SECTIONS
    if "." in m[0] or "e" in m[0]:
        x = float(m[0])
        choices = [x * 2, x / 2, 0.0, x + 1] + ([] if bounded else [-x, 1e300, ".nan"])
    else:
        n = int(m[0])
        choices = [n + 1, max(n - 1, 0), 0, 1, 2 * n if n <= 4096 else n + 1, n // 2]
        if not bounded:
            others = [int(k[0]) for k in found if "." not in k[0] and "e" not in k[0]]
            choices += [-1, 2 ** 62, others[j // 16 % len(others)]]
    return text[:m.start()] + str(choices[j % len(choices)]) + text[m.end():]


def _section_at(text: str, pos: int) -> str:
    """The top-level key whose value holds position `pos`."""
    for line in reversed(text[:pos].splitlines()):
        if line[:1].isalpha():
            return line.split(":", 1)[0]
    return ""


def _lines(text: str) -> list[str]:
    return text.splitlines(keepends=True)


def _delete_line(text: str, i: int, j: int) -> str:
    lines = _lines(text)
    del lines[i % len(lines)]
    return "".join(lines)


def _duplicate_line(text: str, i: int, j: int) -> str:
    lines = _lines(text)
    k = i % len(lines)
    lines.insert(k, lines[k])
    return "".join(lines)


def _move_line(text: str, i: int, j: int) -> str:
    """Line i moved by 1 to 8 lines up or down (j): an edit that keeps most of the file."""
    lines = _lines(text)
    k = i % len(lines)
    line = lines.pop(k)
    step = j % 8 + 1
    lines.insert(max(0, min(len(lines), k + (step if j // 8 % 2 else -step))), line)
    return "".join(lines)


_ENTRY = re.compile(r"^(\s*- \{)(.*)(\}\s*)$")
_KEY = re.compile(r"(\w+): ")


def _reorder_keys(text: str, i: int, j: int) -> str:
    """The keys of the i-th one-line list entry (an op or a buffer) rotated by j: the same
    schedule, written another way."""
    lines = _lines(text)
    entries = [k for k, line in enumerate(lines) if _ENTRY.match(line)]
    if not entries:
        return text
    k = entries[i % len(entries)]
    head, body, tail = _ENTRY.match(lines[k]).groups()
    starts = [m.start() for m in _KEY.finditer(body) if _depth(body, m.start()) == 0]
    items = [body[a:b].strip().rstrip(",") for a, b in zip(starts, starts[1:] + [len(body)])]
    r = j % len(items)
    lines[k] = head + ", ".join(items[r:] + items[:r]) + tail
    return "".join(lines)


def _depth(body: str, pos: int) -> int:
    return body[:pos].count("[") - body[:pos].count("]")


_TEXT = {"word": _word, "number": _number, "delete_line": _delete_line,
         "duplicate_line": _duplicate_line, "move_line": _move_line,
         "reorder_keys": _reorder_keys}


def _renumbered(s: Schedule, order: list[int]) -> Schedule:
    """`s` with its ops in `order` (old ids; an id twice is a copy, a missing one deleted),
    ids, deps and buffer references renumbered. A dependency on a deleted op is dropped, a
    buffer that a deleted op allocates or frees goes too; a copy refers to the first."""
    new = {}
    for position, old in enumerate(order):
        new.setdefault(old, position)
    ops = tuple(replace(s.ops[old], id=position,
                        deps=tuple(new[d] for d in s.ops[old].deps if d in new))
                for position, old in enumerate(order))
    buffers = tuple(replace(b, alloc=None if b.alloc is None else new[b.alloc],
                            free=None if b.free is None else new[b.free])
                    for b in s.buffers
                    if (b.alloc is None or b.alloc in new) and (b.free is None or b.free in new))
    return replace(s, ops=ops, buffers=buffers)


def _delete_op(s: Schedule, i: int, j: int) -> Schedule:
    gone = i % len(s.ops)
    return _renumbered(s, [k for k in range(len(s.ops)) if k != gone])


def _duplicate_op(s: Schedule, i: int, j: int) -> Schedule:
    k = i % len(s.ops)
    order = list(range(len(s.ops)))
    order.insert(k + 1, k)
    return _renumbered(s, order)


def _move_op(s: Schedule, i: int, j: int) -> Schedule:
    """Op i moved by 1 to 4 places (j), earlier or later."""
    order = list(range(len(s.ops)))
    k = i % len(order)
    op = order.pop(k)
    step = j % 4 + 1
    order.insert(max(0, min(len(order), k + (step if j // 4 % 2 else -step))), op)
    return _renumbered(s, order)


def _with_op(s: Schedule, op: Op) -> Schedule:
    ops = list(s.ops)
    ops[op.id] = op
    return replace(s, ops=tuple(ops))


def _drop_dep(s: Schedule, i: int, j: int) -> Schedule:
    waiting = [op for op in s.ops if op.deps]
    if not waiting:
        return s
    op = waiting[i % len(waiting)]
    gone = op.deps[j % len(op.deps)]
    return _with_op(s, replace(op, deps=tuple(d for d in op.deps if d != gone)))


def _add_dep(s: Schedule, i: int, j: int) -> Schedule:
    if len(s.ops) < 2:
        return s
    op = s.ops[1 + i % (len(s.ops) - 1)]
    return _with_op(s, replace(op, deps=tuple(sorted({*op.deps, j % op.id}))))


def _move_buffer_end(s: Schedule, i: int, j: int, end: str) -> Schedule:
    buffers = list(s.buffers)
    if not buffers:
        return s
    k = i % len(buffers)
    now = getattr(buffers[k], end)
    moved = (j % len(s.ops)) if now is None else max(0, min(len(s.ops) - 1, now + j % 7 - 3))
    buffers[k] = replace(buffers[k], **{end: moved})
    return replace(s, buffers=tuple(buffers))


_OPS = {"delete_op": _delete_op, "duplicate_op": _duplicate_op, "move_op": _move_op,
        "drop_dep": _drop_dep, "add_dep": _add_dep,
        "move_alloc": lambda s, i, j: _move_buffer_end(s, i, j, "alloc"),
        "move_free": lambda s, i, j: _move_buffer_end(s, i, j, "free")}
