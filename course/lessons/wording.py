"""A count with its noun in the number it takes: counted(1, "token") is '1 token', counted(3, "miss", "misses")
is '3 misses'."""
from __future__ import annotations


def counted(n: int, singular: str, plural: str | None = None) -> str:
    """`n` and the noun in the number it takes: '1 token', '0 tokens', '1,024 tokens', '2 misses' (pass the
    plural when it is not the singular + 's')."""
    return f"{n:,} {singular if n == 1 else plural or singular + 's'}"
