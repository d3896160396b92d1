"""Copies of a function with a code object of their own, for torch.compile: dynamo keeps its compiled code, its
recompile limit and its record of which sizes changed per code object, so two compiles of one function (two
engines' flex kernels, two shapes' decode steps) share none of them when each compiles its own copy."""

from __future__ import annotations

import types
from collections.abc import Callable


def own_copy(fn: Callable) -> Callable:
    copy = types.FunctionType(fn.__code__.replace(), fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__)
    copy.__kwdefaults__ = fn.__kwdefaults__
    return copy
