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
from typing import TYPE_CHECKING, Any, TypeAlias, TypeVar, cast, overload

if TYPE_CHECKING:
    from polars import Expr

Num: TypeAlias = "int | Expr"
"""A known integer, or an integer polars expression (whose rows may be null). The functions
here return the kind they are given (their overloads say so: ``int`` in, ``int`` out;
an expression anywhere in, an expression out)."""
MaybeNum: TypeAlias = "int | Expr | None"
"""A `Num` that may be unknown: None for a plain value (null rows in an expression)."""
Truth: TypeAlias = "bool | Expr"
"""A ``bool``, or a boolean polars expression."""
Label: TypeAlias = "str | Expr | None"
"""A name (a lookup result, a cause, a verdict: keytrace's StrEnums are strings), unknown
(None), or a string/categorical polars expression."""
Plain: TypeAlias = "int | str | None"
"""Any plain value a definition reads (``bool`` is an ``int``, a StrEnum member a ``str``)."""
Labels: TypeAlias = "Sequence[str] | Expr"
"""A list of names, or a list column of them."""

T = TypeVar("T")


_PLAIN_TYPES = frozenset({int, bool, float, str, type(None)})
"""Types that are never an expression: `is_expr` answers for them without reading a
module name (the live alarm asks it some 200 times per judged episode)."""


def is_expr(*xs: object) -> bool:
    """Any of ``xs`` is a polars expression (then the result is one)."""
    for x in xs:
        t = type(x)
        if t not in _PLAIN_TYPES and t.__module__.startswith("polars"):
            return True
    return False


def _pl() -> Any:
    import polars as pl

    return pl


def as_expr(x: object) -> Expr:
    """``x``, known to be an expression (an `is_expr` branch): what mypy cannot infer."""
    return cast("Expr", x)


def plain_of(x: T | Expr) -> T:
    """``x``, known to be plain (the live alarm calls a definition with plain values only):
    the result's plain type, for mypy."""
    return cast("T", x)


def lit(x: object) -> Expr:
    """``x`` as an expression (None: a null; an enum member: its value)."""
    if is_expr(x):
        return as_expr(x)
    return cast("Expr", _pl().lit(x.value if isinstance(x, Enum) else x))


@overload
def known(x: Expr) -> Expr: ...
@overload
def known(x: Plain) -> bool: ...
def known(x: Expr | Plain) -> Truth:
    """``x`` is not unknown."""
    if type(x) in _PLAIN_TYPES:  # the alarm's case, without a call (as in `unknown`)
        return x is not None
    return as_expr(x).is_not_null() if is_expr(x) else x is not None


@overload
def unknown(x: Expr) -> Expr: ...
@overload
def unknown(x: Plain) -> bool: ...
def unknown(x: Expr | Plain) -> Truth:
    """``x`` is unknown (None / null)."""
    if type(x) in _PLAIN_TYPES:
        return x is None
    return as_expr(x).is_null() if is_expr(x) else x is None


def _compare(a: MaybeNum, b: MaybeNum, op: Callable[[Any, Any], Any]) -> Truth:
    if (type(a) not in _PLAIN_TYPES or type(b) not in _PLAIN_TYPES) and is_expr(a, b):
        return as_expr(op(lit(a), lit(b))).fill_null(False)
    return a is not None and b is not None and bool(op(a, b))


@overload
def lt(a: int | None, b: int | None) -> bool: ...
@overload
def lt(a: Expr, b: MaybeNum) -> Expr: ...
@overload
def lt(a: MaybeNum, b: Expr) -> Expr: ...
def lt(a: MaybeNum, b: MaybeNum) -> Truth:
    """``a < b``, False when either is unknown."""
    return _compare(a, b, lambda x, y: x < y)


@overload
def le(a: int | None, b: int | None) -> bool: ...
@overload
def le(a: Expr, b: MaybeNum) -> Expr: ...
@overload
def le(a: MaybeNum, b: Expr) -> Expr: ...
def le(a: MaybeNum, b: MaybeNum) -> Truth:
    """``a <= b``, False when either is unknown."""
    return _compare(a, b, lambda x, y: x <= y)


@overload
def gt(a: int | None, b: int | None) -> bool: ...
@overload
def gt(a: Expr, b: MaybeNum) -> Expr: ...
@overload
def gt(a: MaybeNum, b: Expr) -> Expr: ...
def gt(a: MaybeNum, b: MaybeNum) -> Truth:
    """``a > b``, False when either is unknown."""
    return _compare(a, b, lambda x, y: x > y)


@overload
def ge(a: int | None, b: int | None) -> bool: ...
@overload
def ge(a: Expr, b: MaybeNum) -> Expr: ...
@overload
def ge(a: MaybeNum, b: Expr) -> Expr: ...
def ge(a: MaybeNum, b: MaybeNum) -> Truth:
    """``a >= b``, False when either is unknown."""
    return _compare(a, b, lambda x, y: x >= y)


@overload
def eq(a: Plain, b: Plain) -> bool: ...
@overload
def eq(a: Expr, b: Plain | Expr) -> Expr: ...
@overload
def eq(a: Plain | Expr, b: Expr) -> Expr: ...
def eq(a: Plain | Expr, b: Plain | Expr) -> Truth:
    """``a == b``, False when ``a`` is unknown."""
    if is_expr(a, b):
        return (lit(a) == lit(b)).fill_null(False)
    return a is not None and a == b


@overload
def as_int(a: bool) -> int: ...
@overload
def as_int(a: Expr) -> Expr: ...
def as_int(a: Truth) -> Num:
    """A known truth value as 0 or 1 (to rank by it)."""
    return as_expr(a).cast(_pl().Int64) if is_expr(a) else int(bool(a))


@overload
def negate(a: bool) -> bool: ...
@overload
def negate(a: Expr) -> Expr: ...
def negate(a: Truth) -> Truth:
    """``not a`` for a known truth value (``~`` on a Python bool is an int, never False)."""
    if type(a) is bool:
        return not a
    return ~as_expr(a) if is_expr(a) else not a


def plain(values: Iterable[object]) -> list[object]:
    """``values`` with every enum member as its value: what polars gets. keytrace's
    vocabularies are StrEnums, and polars reads a list that starts with an enum
    member as its own Enum type, which a Categorical column then refuses to compare with."""
    return [v.value if isinstance(v, Enum) else v for v in values]


@overload
def member(x: Plain, values: Sequence[object]) -> bool: ...
@overload
def member(x: Expr, values: Sequence[object]) -> Expr: ...
def member(x: Plain | Expr, values: Sequence[object]) -> Truth:
    """``x in values`` (False for an unknown ``x``)."""
    if x is None or isinstance(x, str):  # a name (a StrEnum member too): never an expression
        return x in values
    if is_expr(x):
        return as_expr(x).is_in(plain(values)).fill_null(False)
    return x in values


def _plain(xs: tuple[MaybeNum, ...]) -> list[int]:
    """``xs`` with the unknown ones left out, known to be plain (no `is_expr`)."""
    return cast("list[int]", [x for x in xs if x is not None])


@overload
def least(*xs: int) -> int: ...
@overload
def least(*xs: Num) -> Num: ...
def least(*xs: Num) -> Num:
    """The smallest of ``xs``, every one known (an unknown one is an error for plain
    values; see `least_known`)."""
    if is_expr(*xs):
        return cast("Expr", _pl().min_horizontal(*(lit(x) for x in xs)))
    return min(cast("tuple[int, ...]", xs))


@overload
def greatest(*xs: int) -> int: ...
@overload
def greatest(*xs: Num) -> Num: ...
def greatest(*xs: Num) -> Num:
    """The largest of ``xs``, every one known (see `greatest_known`)."""
    if is_expr(*xs):
        return cast("Expr", _pl().max_horizontal(*(lit(x) for x in xs)))
    return max(cast("tuple[int, ...]", xs))


@overload
def least_known(*xs: int | None) -> int | None: ...
@overload
def least_known(*xs: MaybeNum) -> MaybeNum: ...
def least_known(*xs: MaybeNum) -> MaybeNum:
    """The smallest known value of ``xs`` (None / null when none is known): an unknown
    bound is no bound (polars' ``min_horizontal`` ignores nulls alike)."""
    if is_expr(*xs):
        return cast("Expr", _pl().min_horizontal(*(lit(x) for x in xs)))
    got = _plain(xs)
    return min(got) if got else None


@overload
def greatest_known(*xs: int | None) -> int | None: ...
@overload
def greatest_known(*xs: MaybeNum) -> MaybeNum: ...
def greatest_known(*xs: MaybeNum) -> MaybeNum:
    """The largest known value of ``xs`` (None / null when none is known)."""
    if is_expr(*xs):
        return cast("Expr", _pl().max_horizontal(*(lit(x) for x in xs)))
    got = _plain(xs)
    return max(got) if got else None


@overload
def coalesce(*xs: int | None) -> int | None: ...
@overload
def coalesce(*xs: MaybeNum) -> MaybeNum: ...
def coalesce(*xs: MaybeNum) -> MaybeNum:
    """The first known value of ``xs``."""
    if is_expr(*xs):
        return cast("Expr", _pl().coalesce(*(lit(x) for x in xs)))
    return next((x for x in xs if x is not None), None)


Case: TypeAlias = "tuple[Truth | Callable[[], Truth], T | Callable[[], T]]"
"""(condition, value): each may be a zero-argument function (see `cases`)."""


def _value(x: T | Callable[[], T]) -> T:
    return x() if callable(x) else x


def cases(choices: Sequence[Case[T]], default: T | Callable[[], T]) -> T | Expr:
    """The value of the first choice whose condition holds, else ``default``.

    A condition or a value may be a zero-argument function: for plain values each is called
    only when reached (a later condition may rely on an earlier one being false, as in an
    ``elif`` chain); when any is an expression, every one is evaluated into a single
    ``when/then`` chain, in order (first match wins there too). Plain string values become
    string literals in polars."""
    evaluated: list[tuple[Truth, T]] = []
    for condition, value in choices:
        c = condition() if callable(condition) else condition
        if type(c) is bool or not is_expr(c):
            if c and not evaluated:
                return _value(value)
            if not c:
                continue
            c = lit(True)  # a plain True after an expression: it ends the chain
        evaluated.append((c, _value(value)))
    if not evaluated:
        return _value(default)
    pl = _pl()
    chain: Any = None
    for c, v in evaluated:
        chain = pl.when(c).then(lit(v)) if chain is None else chain.when(c).then(lit(v))
    return cast("Expr", chain.otherwise(lit(_value(default))))
