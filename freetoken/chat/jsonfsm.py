"""An incremental matcher for JSON text constrained by a schema, one byte at a time.

It answers "is this still the start of a valid instance?" after every byte, which is what
constrained decoding needs: a token may be sampled only if its bytes keep the output such a
prefix. It works on UTF-8 bytes rather than characters because tokens of byte-level
vocabularies may end inside a character.

A state is a frozenset of stacks (several when `anyOf` alternatives are still open); a stack
is a linked tuple `(frame, parent)`; frames are small tuples, so states are immutable and
hashable and callers can cache by them. Containers push the child's frame over their own
frame already advanced past the child, so a value that ends simply pops. Numbers and
literals that may be complete also pass the byte on to their parent ("12" may go on or end).

Keys of an object that declares no properties (format "json") are not checked for
repeats. Whitespace between tokens is nothing, one space, or a newline and up to `WS_MAX`
spaces or tabs (indentation); numbers have a bounded number of digits; "any" values nest at
most `MAX_DEPTH` deep. So generation under a grammar always ends.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from freetoken.chat.schema import ANY_ARRAY, ANY_NUMBER, ANY_OBJECT, ANY_SCALAR, ANY_STRING, Node

__all__ = ["CLOSE", "WS_MAX", "Grammar", "Matcher", "State", "string_byte"]

WS = frozenset(b" \t\n\r")
WS_MAX = 20  # indentation after a newline
LEAD_MAX = 4  # spaces or newlines before the value
MAX_DEPTH = 16
INT_DIGITS, FRAC_DIGITS, EXP_DIGITS = 15, 15, 3
_HEX = frozenset(b"0123456789abcdefABCDEF")
_ESCAPES = frozenset(b'"\\/bfnrt')
_DIGITS = frozenset(b"0123456789")

# frame tags
ROOT, OBJ, KEY, ARR, STR, NUM, LIT = range(7)
# root phases: leading whitespace, the prefix, whitespace after it, after the value, the
# suffix, done
LEAD, PRE, GAP, POST, SUF, END = range(6)
# object / array phases: after the opener, after a comma, in a key, before ':', before a
# value, after a value
OPEN, NEXT, INKEY, COLON, VALUE, AFTER = range(6)
# number phases
SIGN, ZERO, INT, DOT, FRAC, EXP0, ESIGN, EXP = range(8)
_NUM_DONE = frozenset((ZERO, INT, FRAC, EXP))
CLOSE = -1  # a string's closing quote

Stack = tuple
State = frozenset


@dataclass(frozen=True, eq=False)
class Grammar:
    """A JSON value of `node`, optionally between fixed `prefix` and `suffix` text; or,
    with `others`, any one of it and them (a call whose markup names the tool: one
    alternative per tool)."""

    node: Node
    prefix: bytes = b""
    suffix: bytes = b""
    others: tuple[Grammar, ...] = ()


def _ws(w: int, b: int) -> int:
    """Whitespace run state after byte b (-1: b may not extend it). w: 0 none yet, 1 after
    one space, 2 + k after a newline and k indentation characters."""
    if w == 0:
        return 1 if b == 0x20 else 2 if b == 0x0A else -1
    if w >= 2 and (b == 0x20 or b == 0x09) and w - 2 < WS_MAX:
        return w + 1
    return -1


# pending UTF-8 state -> (lowest, highest) next byte and the state after it; 1..3 are plain
# continuation bytes still due, 4..7 the restricted second byte after E0, ED, F0 and F4
# (no overlong forms, no surrogates, nothing past U+10FFFF)
_CONT = {
    1: (0x80, 0xBF, 0),
    2: (0x80, 0xBF, 1),
    3: (0x80, 0xBF, 2),
    4: (0xA0, 0xBF, 1),
    5: (0x80, 0x9F, 1),
    6: (0x90, 0xBF, 2),
    7: (0x80, 0x8F, 2),
}


def string_byte(esc: int, pending: int, b: int) -> tuple[int, int, int] | int | None:
    """One byte of string content: (esc, pending, characters begun), CLOSE, or None.

    esc: 0 plain, 1 after a backslash, 2..5 inside \\uXXXX; pending: see _CONT.
    """
    if pending:
        lo, hi, rest = _CONT[pending]
        return (0, rest, 0) if lo <= b <= hi else None
    if esc == 0:
        if b == 0x22:
            return CLOSE
        if b == 0x5C:
            return (1, 0, 1)
        if b < 0x20:
            return None
        if b < 0x80:
            return (0, 0, 1)
        if 0xC2 <= b <= 0xDF:
            return (0, 1, 1)
        if 0xE0 <= b <= 0xEF:
            return (0, 4 if b == 0xE0 else 5 if b == 0xED else 2, 1)
        if 0xF0 <= b <= 0xF4:
            return (0, 6 if b == 0xF0 else 7 if b == 0xF4 else 3, 1)
        return None
    if esc == 1:
        if b in _ESCAPES:
            return (0, 0, 0)
        return (2, 0, 0) if b == 0x75 else None
    if b in _HEX:
        return (esc + 1 if esc < 5 else 0, 0, 0)
    return None


class Matcher:
    """Steps states of one grammar. Stateless itself: any number of sequences may share it."""

    def __init__(self, grammar: Grammar):
        self.alts = (grammar, *grammar.others)
        self._steps = (self._root, self._obj, self._key, self._arr, self._str, self._num, self._lit)
        # the root frame: (ROOT, phase, count, alternative); leading whitespace is common
        self._initial: State = frozenset({((ROOT, LEAD, 0, 0), None)})

    # --- the public surface -----------------------------------------------------------
    def initial(self) -> State:
        return self._initial

    def advance(self, state: State, b: int) -> State:
        """The state after byte `b`; empty when `b` cannot follow."""
        if len(state) == 1:
            for stack in state:
                return frozenset(self.step(stack, b))
        out: set[Stack] = set()
        for stack in state:
            out.update(self.step(stack, b))
        return frozenset(out)

    def step_many(self, stacks: list[Stack], b: int) -> list[Stack]:
        """`advance` on a list of stacks (no set built: the cheap form for walking a trie)."""
        if len(stacks) == 1:
            return self.step(stacks[0], b)
        out: list[Stack] = []
        for stack in stacks:
            out += self.step(stack, b)
        return list(dict.fromkeys(out))

    def feed(self, state: State, data: bytes) -> State:
        for b in data:
            state = self.advance(state, b)
            if not state:
                break
        return state

    def step(self, stack: Stack, b: int) -> list[Stack]:
        frame, parent = stack
        return self._steps[frame[0]](frame, parent, b)

    def is_done(self, state: State) -> bool:
        """A whole value (and suffix) has been read: the text may end here."""
        return any(self._done(s) for s in state)

    def is_final(self, state: State) -> bool:
        """Done, and no byte may follow."""
        return bool(state) and all(self._terminal(s) for s in state)

    def allowed_bytes(self, state: State) -> list[int]:
        return [b for b in range(256) if self.advance(state, b)]

    @staticmethod
    def free_string(stack: Stack) -> tuple[int, int, int | None] | None:
        """(escape, pending UTF-8 bytes, characters still allowed or None) when the stack is
        inside string content any character may extend (a free string or an open-ended
        key): escape 0 plain, 1 just after a backslash. None elsewhere, and when a
        restricted UTF-8 byte is due."""
        frame = stack[0]
        if frame[0] == STR and frame[4] < 2 and frame[3] < 4:
            node = frame[1]
            return frame[4], frame[3], None if node.max_len is None else node.max_len - frame[2]
        if frame[0] == KEY and frame[4] and frame[2] < 2 and frame[3] < 4:
            return frame[2], frame[3], None
        return None

    # --- completion -------------------------------------------------------------------
    def _terminal(self, stack: Stack) -> bool:
        """Done, with no byte left that could extend the value (or anything after it)."""
        frame, parent = stack
        tag = frame[0]
        if tag == ROOT:
            return frame[1] == END or (frame[1] == POST and not self.alts[frame[3]].suffix)
        if tag == NUM:
            _, integer, phase, d = frame
            ended = (
                (phase == ZERO and integer)
                or (phase == INT and integer and d == INT_DIGITS)
                or (phase == EXP and d == EXP_DIGITS)
            )
            return ended and self._terminal(parent)
        if tag == LIT:
            matched = frame[2]
            longer = any(len(o) > len(matched) and o.startswith(matched) for o in frame[1].options)
            return matched in frame[1].optset and not longer and self._terminal(parent)
        return False

    def _done(self, stack: Stack) -> bool:
        frame, parent = stack
        tag = frame[0]
        if tag == ROOT:
            return frame[1] == END or (frame[1] == POST and not self.alts[frame[3]].suffix)
        if tag == NUM:
            return frame[2] in _NUM_DONE and self._done(parent)
        if tag == LIT:
            return frame[2] in frame[1].optset and self._done(parent)
        return False

    # --- value starts -----------------------------------------------------------------
    def _start(self, node: Node, depth: int, parent: Stack, b: int) -> list[Stack]:
        """Stacks after `b` begins a value of `node` whose container is `parent`."""
        kind = node.kind
        if kind == "union" or kind == "pending":
            out: list[Stack] = []
            for alt in node.alts:
                out += self._start(alt, depth, parent, b)
            return out
        if kind == "any":
            if b == 0x7B:
                node = ANY_OBJECT if depth < MAX_DEPTH else None
            elif b == 0x5B:
                node = ANY_ARRAY if depth < MAX_DEPTH else None
            elif b == 0x22:
                node = ANY_STRING
            elif b == 0x2D or b in _DIGITS:
                node = ANY_NUMBER
            else:
                node = ANY_SCALAR
            if node is None:
                return []
            kind = node.kind
        if kind == "object":
            if b != 0x7B:
                return []
            return [((OBJ, node, OPEN, 0, 0, frozenset(), None, depth), parent)]
        if kind == "array":
            return [((ARR, node, OPEN, 0, 0, depth), parent)] if b == 0x5B else []
        if kind == "string":
            return [((STR, node, 0, 0, 0), parent)] if b == 0x22 else []
        if kind == "number" or kind == "integer":
            phase = SIGN if b == 0x2D else ZERO if b == 0x30 else INT if b in _DIGITS else None
            return [] if phase is None else [((NUM, kind == "integer", phase, 1), parent)]
        if kind == "literal":
            first = bytes((b,))
            if any(o.startswith(first) for o in node.options):
                return [((LIT, node, first), parent)]
        return []

    # --- frames -----------------------------------------------------------------------
    def _root(self, f: tuple, parent: Stack, b: int) -> list[Stack]:
        _, phase, n, a = f
        g = self.alts[a]
        if phase == LEAD or phase == GAP:
            if b in WS:
                if phase == LEAD:  # a few spaces or newlines first (after thinking: "\n\n")
                    return [((ROOT, LEAD, n + 1, a), None)] if n < LEAD_MAX and b in b" \n" else []
                w = _ws(n, b)
                return [((ROOT, GAP, w, a), None)] if w >= 0 else []
            if phase == LEAD:
                out: list[Stack] = []
                for i, alt in enumerate(self.alts):
                    if alt.prefix:
                        out += self._root((ROOT, PRE, 0, i), None, b)
                    else:
                        out += self._start(alt.node, 0, ((ROOT, POST, 0, i), None), b)
                return out
            return self._start(g.node, 0, ((ROOT, POST, 0, a), None), b)
        if phase == PRE or phase == SUF:
            text = g.prefix if phase == PRE else g.suffix
            if b != text[n]:
                return []
            if n + 1 < len(text):
                return [((ROOT, phase, n + 1, a), None)]
            return [((ROOT, GAP if phase == PRE else END, 0, a), None)]
        if phase == POST and g.suffix:
            if b in WS:
                w = _ws(n, b)
                return [((ROOT, POST, w, a), None)] if w >= 0 else []
            return self._root((ROOT, SUF, 0, a), None, b)
        return []

    def _obj(self, f: tuple, parent: Stack, b: int) -> list[Stack]:
        _, node, phase, ws, idx, extras, cur, depth = f
        if b in WS:
            w = _ws(ws, b)
            return [((OBJ, node, phase, w, idx, extras, cur, depth), parent)] if w >= 0 else []
        open_ended = node.extra is not None and node.first_req[idx] == len(node.props)
        if phase == OPEN or phase == NEXT:
            if b == 0x22 and (idx < len(node.props) or open_ended):
                me = ((OBJ, node, INKEY, 0, idx, extras, None, depth), parent)
                return [((KEY, b"", 0, 0, open_ended), me)]
            if b == 0x7D and phase == OPEN and node.first_req[idx] == len(node.props):
                return [parent]
            return []
        if phase == COLON:
            return [((OBJ, node, VALUE, 0, idx, extras, cur, depth), parent)] if b == 0x3A else []
        if phase == VALUE:
            after = ((OBJ, node, AFTER, 0, idx, extras, None, depth), parent)
            return self._start(cur, depth + 1, after, b)
        if phase == AFTER:
            if b == 0x2C and (idx < len(node.props) or open_ended):
                return [((OBJ, node, NEXT, 0, idx, extras, None, depth), parent)]
            if b == 0x7D and node.first_req[idx] == len(node.props):
                return [parent]
        return []

    def _key(self, f: tuple, parent: Stack, b: int) -> list[Stack]:
        _, raw, esc, pending, open_ended = f
        obj, grand = parent
        node, idx = obj[1], obj[4]
        raw2 = raw + bytes((b,))
        last = min(node.first_req[idx], len(node.props) - 1)
        if not open_ended:
            prefix_of_some = False
            for j in range(idx, last + 1):
                key = node.props[j].key
                if key.startswith(raw2):
                    if len(key) == len(raw2):
                        return [self._keyed(obj, grand, j, None)]
                    prefix_of_some = True
            return [((KEY, raw2, 0, 0, False), parent)] if prefix_of_some else []
        r = string_byte(esc, pending, b)
        if r is None:
            return []
        if not node.props:
            # a free-form object: any name goes, and the key's text need not be kept (so
            # states repeat and masks cache); repeated names are not looked for
            if r != CLOSE:
                return [((KEY, b"", r[0], r[1], True), parent)]
            return [((OBJ, node, COLON, 0, idx, obj[5], node.extra, obj[7]), grand)]
        if r != CLOSE:
            return [((KEY, raw2, r[0], r[1], True), parent)]
        name = json.loads(b'"' + raw + b'"')
        j = node.index.get(name)
        if j is not None:
            return [self._keyed(obj, grand, j, None)] if j >= idx else []
        return [] if name in obj[5] else [self._keyed(obj, grand, len(node.props), name)]

    @staticmethod
    def _keyed(obj: tuple, grand: Stack, j: int, extra_name: str | None) -> Stack:
        """The object frame once a key is read: prop j, or (j == len) an extra key."""
        node, extras, depth = obj[1], obj[5], obj[7]
        if extra_name is None:
            return ((OBJ, node, COLON, 0, j + 1, extras, node.props[j].node, depth), grand)
        return ((OBJ, node, COLON, 0, j, extras | {extra_name}, node.extra, depth), grand)

    def _arr(self, f: tuple, parent: Stack, b: int) -> list[Stack]:
        _, node, phase, ws, count, depth = f
        if b in WS:
            w = _ws(ws, b)
            return [((ARR, node, phase, w, count, depth), parent)] if w >= 0 else []
        more = node.max_items is None or count < node.max_items
        if phase == AFTER:
            if b == 0x2C and more:
                return [((ARR, node, NEXT, 0, count, depth), parent)]
            return [parent] if b == 0x5D and count >= node.min_items else []
        if phase == OPEN and b == 0x5D:
            return [parent] if node.min_items == 0 else []
        item = node.item(count) if more else None
        if item is None:
            return []
        # the count matters up to the bounds only; beyond them states repeat (and cache)
        after = ((ARR, node, AFTER, 0, min(count + 1, node.count_cap), depth), parent)
        return self._start(item, depth + 1, after, b)

    def _str(self, f: tuple, parent: Stack, b: int) -> list[Stack]:
        _, node, n, pending, esc = f
        r = string_byte(esc, pending, b)
        if r is None:
            return []
        if r == CLOSE:
            return [parent] if n >= node.min_len else []
        if r[2]:
            if node.max_len is not None:
                if n >= node.max_len:
                    return []
                n += 1
            elif n < node.min_len:
                n += 1
        return [((STR, node, n, r[1], r[0]), parent)]

    def _num(self, f: tuple, parent: Stack, b: int) -> list[Stack]:
        _, integer, phase, d = f
        digit = b in _DIGITS
        nxt = None
        if phase == SIGN:
            nxt = ZERO if b == 0x30 else INT if digit else None
            d = 1
        elif phase == ZERO or phase == INT:
            if phase == INT and digit and d < INT_DIGITS:
                nxt, d = INT, d + 1
            elif not integer and b == 0x2E:
                nxt = DOT
            elif not integer and (b == 0x65 or b == 0x45):
                nxt = EXP0
        elif phase == DOT:
            nxt, d = (FRAC, 1) if digit else (None, d)
        elif phase == FRAC:
            if digit and d < FRAC_DIGITS:
                nxt, d = FRAC, d + 1
            elif b == 0x65 or b == 0x45:
                nxt = EXP0
        elif phase == EXP0 or phase == ESIGN:
            if phase == EXP0 and (b == 0x2B or b == 0x2D):
                nxt = ESIGN
            elif digit:
                nxt, d = EXP, 1
        elif phase == EXP and digit and d < EXP_DIGITS:
            nxt, d = EXP, d + 1
        out = [((NUM, integer, nxt, d), parent)] if nxt is not None else []
        if phase in _NUM_DONE:
            out += self.step(parent, b)  # the number ended; the byte is its container's
        return out

    def _lit(self, f: tuple, parent: Stack, b: int) -> list[Stack]:
        _, node, matched = f
        m2 = matched + bytes((b,))
        out = [((LIT, node, m2), parent)] if any(o.startswith(m2) for o in node.options) else []
        if matched in node.optset:
            out += self.step(parent, b)
        return out
