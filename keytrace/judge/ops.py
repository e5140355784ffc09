"""The few operators a definition needs, for plain values and for polars expressions alike.

keytrace writes each rule once (`keytrace.judge.rules` for vLLM's arithmetic,
`keytrace.judge.definitions` for its own): the live alarm calls a rule with ints, bools
and None, the differ with polars expressions over millions of rows, and gets back the same
kind. Arithmetic and comparisons are Python's own operators, which both kinds share; what
the two worlds spell differently goes through here:

- *unknown* values: None for plain values, null in polars. `known` and the comparisons
  (`lt`, `le`, `gt`, `ge`) say False where either side is unknown, so a rule never needs
  Python's ``not`` or polars' ``~`` on something that may be unknown (`negate` is for
  known truth values only);
- ``min``/``max`` of several values (`least`, `greatest`: every one known), and of known
  ones only (`least_known`, `greatest_known`: an unknown bound is no bound, like polars'
  ``min_horizontal``);
- a choice (`cases`): the first case whose condition holds. For plain values the
  conditions and values are evaluated lazily, in order, as ``if``/``elif`` would (a value
  may be a zero-argument function, called only when chosen); for expressions every case
  becomes one ``when/then`` chain.

polars is imported only when an expression is involved: the alarm runs in every serving
process and never loads it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from enum import Enum
from typing import Any, TypeAlias

Num: TypeAlias = Any
"""An ``int`` (or None: unknown), or a polars expression evaluating to integers: the
functions here return the same kind they are given (mypy cannot express "int in, int out;
Expr in, Expr out" for operator-based code, so this alias says it in words)."""
Truth: TypeAlias = Any
"""A ``bool``, or a boolean polars expression."""


_PLAIN_TYPES = frozenset({int, bool, float, str, type(None)})
"""Types that are never an expression: `is_expr` answers for them without reading a
module name (the live alarm asks it some 200 times per judged episode)."""


def is_expr(*xs: Any) -> bool:
    """Any of ``xs`` is a polars expression (then the result is one)."""
    for x in xs:
        t = type(x)
        if t not in _PLAIN_TYPES and t.__module__.startswith("polars"):
            return True
    return False


def _pl() -> Any:
    import polars as pl

    return pl


def lit(x: Any) -> Any:
    """``x`` as an expression (None: a null; an enum member: its value)."""
    if is_expr(x):
        return x
    return _pl().lit(x.value if isinstance(x, Enum) else x)


def known(x: Num) -> Truth:
    """``x`` is not unknown."""
    return x.is_not_null() if is_expr(x) else x is not None


def unknown(x: Num) -> Truth:
    """``x`` is unknown (None / null)."""
    return x.is_null() if is_expr(x) else x is None


def _compare(a: Num, b: Num, op: Callable[[Any, Any], Any]) -> Truth:
    if is_expr(a, b):
        return op(lit(a), lit(b)).fill_null(False)
    return a is not None and b is not None and bool(op(a, b))


def lt(a: Num, b: Num) -> Truth:
    """``a < b``, False when either is unknown."""
    return _compare(a, b, lambda x, y: x < y)


def le(a: Num, b: Num) -> Truth:
    """``a <= b``, False when either is unknown."""
    return _compare(a, b, lambda x, y: x <= y)


def gt(a: Num, b: Num) -> Truth:
    """``a > b``, False when either is unknown."""
    return _compare(a, b, lambda x, y: x > y)


def ge(a: Num, b: Num) -> Truth:
    """``a >= b``, False when either is unknown."""
    return _compare(a, b, lambda x, y: x >= y)


def eq(a: Num, b: Any) -> Truth:
    """``a == b``, False when ``a`` is unknown."""
    if is_expr(a, b):
        return (lit(a) == lit(b)).fill_null(False)
    return a is not None and a == b


def as_int(a: Truth) -> Num:
    """A known truth value as 0 or 1 (to rank by it)."""
    return a.cast(_pl().Int64) if is_expr(a) else int(bool(a))


def negate(a: Truth) -> Truth:
    """``not a`` for a known truth value (``~`` on a Python bool is an int, never False)."""
    return ~a if is_expr(a) else not a


def plain(values: Iterable[Any]) -> list[Any]:
    """``values`` with every enum member as its value: what polars gets. keytrace's
    vocabularies are StrEnums, and polars reads a list that starts with an enum
    member as its own Enum type, which a Categorical column then refuses to compare with."""
    return [v.value if isinstance(v, Enum) else v for v in values]


def member(x: Any, values: Sequence[Any]) -> Truth:
    """``x in values`` (False for an unknown ``x``)."""
    if is_expr(x):
        return x.is_in(plain(values)).fill_null(False)
    return x in values


def least(*xs: Num) -> Num:
    """The smallest of ``xs``, every one known (an unknown one is an error for plain
    values; see `least_known`)."""
    if is_expr(*xs):
        return _pl().min_horizontal(*(lit(x) for x in xs))
    return min(xs)


def greatest(*xs: Num) -> Num:
    """The largest of ``xs``, every one known (see `greatest_known`)."""
    if is_expr(*xs):
        return _pl().max_horizontal(*(lit(x) for x in xs))
    return max(xs)


def least_known(*xs: Num) -> Num:
    """The smallest known value of ``xs`` (None / null when none is known): an unknown
    bound is no bound (polars' ``min_horizontal`` ignores nulls alike)."""
    if is_expr(*xs):
        return _pl().min_horizontal(*(lit(x) for x in xs))
    got = [x for x in xs if x is not None]
    return min(got) if got else None


def greatest_known(*xs: Num) -> Num:
    """The largest known value of ``xs`` (None / null when none is known)."""
    if is_expr(*xs):
        return _pl().max_horizontal(*(lit(x) for x in xs))
    got = [x for x in xs if x is not None]
    return max(got) if got else None


def coalesce(*xs: Num) -> Num:
    """The first known value of ``xs``."""
    if is_expr(*xs):
        return _pl().coalesce(*(lit(x) for x in xs))
    return next((x for x in xs if x is not None), None)


Case: TypeAlias = tuple[Any, Any]
"""(condition, value): each may be a zero-argument function (see `cases`)."""


def _value(x: Any) -> Any:
    return x() if callable(x) else x


def cases(choices: Sequence[Case], default: Any) -> Any:
    """The value of the first choice whose condition holds, else ``default``.

    A condition or a value may be a zero-argument function: for plain values each is called
    only when reached (a later condition may rely on an earlier one being false, as in an
    ``elif`` chain); when any is an expression, every one is evaluated into a single
    ``when/then`` chain, in order (first match wins there too). Plain string values become
    string literals in polars."""
    evaluated: list[tuple[Any, Any]] = []
    for condition, value in choices:
        c = _value(condition)
        if not is_expr(c):
            if c and not evaluated:
                return _value(value)
            if not c:
                continue
            c = _pl().lit(True)  # a plain True after an expression: it ends the chain
        evaluated.append((c, _value(value)))
    if not evaluated:
        return _value(default)
    pl = _pl()
    chain: Any = None
    for c, v in evaluated:
        chain = pl.when(c).then(lit(v)) if chain is None else chain.when(c).then(lit(v))
    return chain.otherwise(lit(_value(default)))
