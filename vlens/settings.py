"""Settings declared once. Each job's settings (engine, harvest, server) are one dataclass whose fields
carry their default, their allowed values and their help text; Python keyword arguments, command-line
flags and validation are all derived from that one declaration, so a setting is never listed twice.

    @dataclass(frozen=True)
    class EngineConfig:
        block_size: int = setting(16, "tokens per KV-cache block", minimum=1)

    EngineConfig.from_kwargs(kwargs)   # ValueError naming an unknown or invalid setting
    add_flags(parser, EngineConfig)    # --block-size, typed, with the help and default
    config = from_args(EngineConfig, parsed_args)
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Callable, Iterable
from typing import Any

_BASE_TYPES = {"int": int, "float": float, "str": str, "bool": bool}


def setting(
    default: Any,
    help: str,
    *,
    choices: Iterable[Any] | None = None,
    minimum: float | None = None,
    flag: str | None = None,
    invert: bool = False,
    check: Callable[[Any], str | None] | None = None,
) -> Any:
    """A dataclass field for one setting.

    choices / minimum: what validation allows (None, where the type admits it, is always allowed);
    flag: the command-line flag when it is not `--field-name` ("" for no flag);
    invert: a bool setting whose flag turns it off (`--no-bos` for prepend_bos=True);
    check: a last test of the value, returning what is wrong with it (or None)."""
    meta = {"help": help, "choices": tuple(choices) if choices is not None else None, "minimum": minimum,
            "flag": flag, "invert": invert, "check": check}  # fmt: skip
    if isinstance(default, (list, dict, set)):
        return dataclasses.field(default_factory=lambda: type(default)(default), metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


def _kind(f: dataclasses.Field) -> tuple[type | None, bool, bool]:
    """(base type, is a list of it, admits None) read off the field's annotation string."""
    parts = [p.strip() for p in str(f.type).split("|")]
    optional = "None" in parts
    parts = [p for p in parts if p != "None"]
    base = parts[0] if len(parts) == 1 else ""
    many = base.startswith(("list[", "tuple["))
    if many:
        base = base[base.index("[") + 1 : -1].split(",")[0].strip()
    return _BASE_TYPES.get(base), many, optional


def validate(config: Any) -> None:
    """Check every field of a settings dataclass; ValueError naming the first bad one and what it allows."""
    for f in dataclasses.fields(config):
        value, meta = getattr(config, f.name), f.metadata
        if not meta:
            continue
        base, many, optional = _kind(f)
        if value is None and optional:
            continue
        items = list(value) if many and isinstance(value, (list, tuple)) else [value]
        for item in items:
            problem = _problem(item, base, meta)
            if problem:
                raise ValueError(f"{f.name}: {item!r} is not {problem}")
        if meta["check"] is not None:
            problem = meta["check"](value)
            if problem:
                raise ValueError(f"{f.name}: {value!r} is not {problem}")


def _problem(value: Any, base: type | None, meta: dict) -> str | None:
    if meta["choices"] is not None:
        return None if value in meta["choices"] else "one of " + ", ".join(map(str, meta["choices"]))
    if base is bool and not isinstance(value, bool):
        return "true or false"
    if base is int and (not isinstance(value, int) or isinstance(value, bool)):
        return "an int" + (f" >= {meta['minimum']}" if meta["minimum"] is not None else "")
    if base is float and (not isinstance(value, (int, float)) or isinstance(value, bool)):
        return "a number" + (f" >= {meta['minimum']}" if meta["minimum"] is not None else "")
    if meta["minimum"] is not None and isinstance(value, (int, float)) and value < meta["minimum"]:
        return f"{'an int' if base is int else 'a number'} >= {meta['minimum']}"
    return None


def from_kwargs(cls: type, kwargs: dict[str, Any]) -> Any:
    """`cls(**kwargs)`, with an unknown name a ValueError that lists the known ones (not a TypeError)."""
    known = [f.name for f in dataclasses.fields(cls) if f.init]
    unknown = sorted(set(kwargs) - set(known))
    if unknown:
        raise ValueError(f"{unknown[0]}: unknown setting; known settings: {', '.join(known)}")
    return cls(**kwargs)


def flag_name(f: dataclasses.Field) -> str:
    flag = f.metadata.get("flag")
    return flag if flag is not None else "--" + f.name.replace("_", "-")


def add_flags(parser: argparse.ArgumentParser | argparse._ArgumentGroup, cls: type, skip: Iterable[str] = ()) -> None:
    """One flag per field of `cls` (but those in `skip`, or declared with flag=""), typed from its annotation."""
    for f in dataclasses.fields(cls):
        if f.name in skip or not f.metadata or flag_name(f) == "":
            continue
        meta, (base, many, _) = f.metadata, _kind(f)
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        kwargs: dict[str, Any] = {"dest": f.name, "help": meta["help"]}
        if base is bool:
            kwargs["action"] = "store_false" if meta["invert"] else "store_true"
        else:
            kwargs["type"] = base or str
            if many:
                kwargs["nargs"] = "+"
            if meta["choices"] is not None:
                kwargs["choices"] = list(meta["choices"])
            if default is not None:
                kwargs["help"] += f" (default: {default})"
        parser.add_argument(flag_name(f), default=default, **kwargs)


def from_args(cls: type, args: argparse.Namespace, **overrides: Any) -> Any:
    """The settings of `cls` that the parsed command line holds, plus `overrides`, validated."""
    names = {f.name for f in dataclasses.fields(cls) if f.init}
    values = {name: getattr(args, name) for name in names if hasattr(args, name)}
    return cls(**(values | overrides))
