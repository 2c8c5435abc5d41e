"""What a class's fast paths stand for, as its file defined it: one test that a class (the
class itself later, or a subclass) still runs those methods, for the call plan."""

from __future__ import annotations

import operator
from collections.abc import Callable


def as_defined(cls: type) -> Callable[[type], bool]:
    """A test that a class runs every method, property and staticmethod `cls` defines now
    (not __init__: construction, whose result the plan reads; not classmethods, bound anew
    on each read), read in one C call (operator.attrgetter) and compared by identity: False
    for a subclass overriding one and for a later class-level patch of `cls`.

    Args:
        cls: the class, right after its definition.

    Returns:
        `test(klass) -> bool`.
    """
    names = tuple(
        name
        for name, value in vars(cls).items()
        if (callable(value) or isinstance(value, (property, staticmethod))) and name != "__init__"
    )
    read = operator.attrgetter(*names)
    defined = read(cls)
    return lambda klass: read(klass) == defined
