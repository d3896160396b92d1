"""Settings declared once. Each job's settings (engine, harvest, server) are one dataclass whose fields
carry their default, their allowed values and their help text; Python keyword arguments, command-line
flags and validation are all derived from that one declaration, so a setting is never listed twice.

    @dataclass(frozen=True)
    class EngineConfig:
        block_size: int = setting(16, "tokens per KV-cache block", minimum=1)

    EngineConfig.from_kwargs(kwargs)   # ValueError naming an unknown or invalid setting
    add_flags(parser, EngineConfig)    # --block-size, typed, with the help and default
    config = from_args(EngineConfig, parsed_args)

Errors read `name: what is wrong, and what is allowed`, the same from Python and from the command line
(where `vlens.cli.main` prints them as `vlens: error: ...`); that is why the flags leave choices and
ranges to `validate` instead of argparse, whose messages name the flag in another style.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from collections.abc import Callable, Iterable
from typing import Any

# (a dict setting is given as a JSON object on the command line, and may be from Python: `--hf-overrides '{...}'`)
_BASE_TYPES = {"int": int, "float": float, "str": str, "bool": bool, "dict": dict}
REQUIRED: Any = dataclasses.MISSING  # the default of a setting that must be given (a required flag)


def setting(
    default: Any,
    help: str,
    *,
    choices: Iterable[Any] | None = None,
    minimum: float | None = None,
    flag: str | None = None,
    invert: bool = False,
    const: Any = dataclasses.MISSING,
    check: Callable[[Any], str | None] | None = None,
    repeat: bool = False,
) -> Any:
    """A dataclass field for one setting (`REQUIRED` as the default: it has none).

    choices / minimum: what validation allows (None, where the type admits it, is always allowed);
    flag: the command-line flag when it is not `--field-name` ("" for no flag);
    invert: a bool setting whose flag turns it off (`--no-bos` for prepend_bos=True);
    const: the value a flag that takes no argument sets (`--ray` for backend="ray");
    check: a last test of the value, returning what is wrong with it and what is allowed (or None);
    repeat: a setting of several values whose flag takes one value and is repeated (`--sae a=x --sae b=y`)."""
    meta = {"help": help, "choices": tuple(choices) if choices is not None else None, "minimum": minimum,
            "flag": flag, "invert": invert, "const": const, "check": check, "repeat": repeat}  # fmt: skip
    if isinstance(default, (list, dict, set)):
        return dataclasses.field(default_factory=lambda: type(default)(default), metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


def positive(value: Any) -> str | None:
    """A `check` for numbers that must be above zero (a `minimum` is inclusive)."""
    return None if value > 0 else f"must be a number > 0, got {value!r}"


def _kind(f: dataclasses.Field) -> tuple[type | None, bool, bool]:
    """(base type, is a tuple of it, admits None) read off the field's annotation string."""
    parts = [p.strip() for p in str(f.type).split("|")]
    optional = "None" in parts
    parts = [p for p in parts if p != "None"]
    base = parts[0] if len(parts) == 1 else ""
    many = base.startswith(("list[", "tuple["))
    if many:
        base = base[base.index("[") + 1 : -1].split(",")[0].strip()
    return _BASE_TYPES.get(base.partition("[")[0]), many, optional


def _default(f: dataclasses.Field) -> Any:
    return f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default


def validate(config: Any) -> None:
    """Check every field of a settings dataclass; ValueError naming the first bad one and what it allows.

    A setting that holds several values is stored as a tuple (one value, a string included, becomes a
    tuple of one), so a frozen config holds nothing that changes under it."""
    for f in dataclasses.fields(config):
        value, meta = getattr(config, f.name), f.metadata
        if not meta:
            continue
        base, many, optional = _kind(f)
        if value is None and optional:
            continue
        if many:
            value = tuple(value) if isinstance(value, Iterable) and not isinstance(value, str) else (value,)
            object.__setattr__(config, f.name, value)
        if base is dict and isinstance(value, str):
            try:
                value = json.loads(value)
            except ValueError as e:
                raise ValueError(f"{f.name}: {value!r} is not JSON ({e}); expected a JSON object") from None
            object.__setattr__(config, f.name, value)
        for item in value if many else [value]:
            problem = _problem(item, base, meta)
            if problem:
                raise ValueError(f"{f.name}: {problem}")
        problem = meta["check"](value) if meta["check"] is not None else None
        if problem:
            raise ValueError(f"{f.name}: {problem}")


def _problem(value: Any, base: type | None, meta: dict) -> str | None:
    """What is wrong with one value, and what is allowed; None when nothing is."""
    if meta["choices"] is not None:
        return None if value in meta["choices"] else f"{value!r} is not one of {', '.join(map(str, meta['choices']))}"
    if base is bool:
        return None if isinstance(value, bool) else f"must be true or false, got {value!r}"
    if base is dict:
        return None if isinstance(value, dict) and all(isinstance(k, str) for k in value) else \
            f"expected a dict of names (a JSON object), got {value!r}"  # fmt: skip
    if base not in (int, float):
        return None
    is_int = isinstance(value, int) and not isinstance(value, bool)
    ok = is_int or (base is float and isinstance(value, float))
    if ok and (meta["minimum"] is None or value >= meta["minimum"]):
        return None
    wanted = "an integer" if base is int else "a number"
    return f"must be {wanted}" + (f" >= {meta['minimum']}" if meta["minimum"] is not None else "") + f", got {value!r}"


def from_kwargs(cls: type, kwargs: dict[str, Any]) -> Any:
    """`cls(**kwargs)`, with an unknown name a ValueError that lists the known ones (not a TypeError)."""
    known = [f.name for f in dataclasses.fields(cls) if f.init]
    unknown = sorted(set(kwargs) - set(known))
    if unknown:
        raise ValueError(f"{unknown[0]}: unknown setting; known settings: {', '.join(known)}")
    return cls(**kwargs)


def values(config: Any) -> dict[str, Any]:
    """The settings as keyword arguments; unlike `dataclasses.asdict`, a model a setting holds is not copied."""
    return {f.name: getattr(config, f.name) for f in dataclasses.fields(config) if f.init}


def flag_name(f: dataclasses.Field) -> str:
    flag = f.metadata.get("flag")
    return flag if flag is not None else "--" + f.name.replace("_", "-")


def add_flags(
    parser: argparse.ArgumentParser | argparse._ArgumentGroup,
    cls: type,
    skip: Iterable[str] = (),
    only: Iterable[str] | None = None,
) -> None:
    """One flag per field of `cls` (those in `only` when given, but not those in `skip` or declared with
    flag=""), typed from its annotation; a setting without a default is a required flag."""
    skip, only = set(skip), None if only is None else set(only)
    for f in dataclasses.fields(cls):
        if f.name in skip or (only is not None and f.name not in only) or not f.metadata or flag_name(f) == "":
            continue
        meta, (base, many, _), default = f.metadata, _kind(f), _default(f)
        kwargs: dict[str, Any] = {"dest": f.name, "help": meta["help"]}
        if default is REQUIRED:
            kwargs["required"] = True
        else:
            kwargs["default"] = default
        if base is bool:
            kwargs["action"] = "store_false" if meta["invert"] else "store_true"
            kwargs["help"] = f"turn off {f.name} (on by default: {meta['help']})" if meta["invert"] else meta["help"]
        elif meta["const"] is not dataclasses.MISSING:
            kwargs.update(action="store_const", const=meta["const"])
            kwargs["help"] = f"{f.name} {meta['const']!r} instead of {default!r}: {meta['help']}"
        else:
            kwargs["type"] = str if base in (None, dict) else base
            if many and meta["repeat"]:
                kwargs["action"] = "append"
            elif many:
                kwargs["nargs"] = "+"
            choices = meta["choices"]
            kwargs["metavar"] = (
                "{" + ",".join(map(str, choices)) + "}" if choices else flag_name(f)[2:].upper().replace("-", "_")
            )
            if default not in (None, REQUIRED) and "(default" not in meta["help"]:
                kwargs["help"] += f" (default: {default})"
        parser.add_argument(flag_name(f), **kwargs)


def from_args(cls: type, args: argparse.Namespace, **overrides: Any) -> Any:
    """The settings of `cls` that the parsed command line holds, plus `overrides`, validated."""
    names = {f.name for f in dataclasses.fields(cls) if f.init}
    given = {name: getattr(args, name) for name in names if hasattr(args, name)}
    return cls(**(given | overrides))
