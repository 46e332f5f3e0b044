"""Which columns of the report's terminal table fit the console's width, and how wide each is: no word of a cell (a
number, a precision's name) is ever cut; where even the narrowest layout is too wide, the least important columns
are left out, in a stated order, instead."""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["fit_columns", "table_width"]

# rich's default table (a box with edges, one space either side of a cell): each column costs its text, two spaces
# and the rule after it, and the table one rule more at its left edge.
PER_COLUMN = 3
EDGE = 1


def _longest_word(text: str) -> int:
    return max((len(word) for word in text.split()), default=0)


def table_width(widths: Sequence[int]) -> int:
    """The characters a table of columns this wide takes on a line, borders included."""
    return EDGE + sum(w + PER_COLUMN for w in widths)


def fit_columns(headers: Sequence[str], rows: Sequence[Sequence[str]], width: int,
                least_important: Sequence[int]) -> tuple[list[int], list[int]]:
    """The indices of the columns to show, in order, and each one's text width, for a table at most ``width``
    characters wide. A column may wrap at spaces (headers and cells) but is never narrower than its longest word, so
    no number is cut; while the columns at those widths are too wide, the next of ``least_important`` is left out
    (the columns it does not name are always kept: the result may then be wider than ``width``). The room left is
    shared out widest column first, so the table wraps as little as it can."""
    columns = range(len(headers))
    narrowest = [max([_longest_word(headers[i]), *(_longest_word(r[i]) for r in rows)]) for i in columns]
    whole = [max([len(headers[i]), *(len(r[i]) for r in rows)]) for i in columns]
    kept = list(columns)
    for i in least_important:
        if table_width([narrowest[k] for k in kept]) <= width:
            break
        kept.remove(i)
    widths = {i: whole[i] for i in kept}
    excess = table_width(list(widths.values())) - width
    while excess > 0:
        wrappable = [i for i in kept if widths[i] > narrowest[i]]
        if not wrappable:
            break
        widest = max(wrappable, key=lambda i: widths[i])
        widths[widest] -= 1
        excess -= 1
    return kept, [widths[i] for i in kept]
