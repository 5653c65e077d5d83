"""Command lines generated from pydantic settings models: one definition of each knob.

Every field of a settings model becomes a flag `--field-name` whose help is the field's
description with its default shown, so adding a knob to a process is adding one field.
Booleans get `--x/--no-x`; list fields repeat the flag; dict fields take KEY=VALUE pairs.
A field that is itself a settings model gets a flag per field of its own, named with the
prefix its `cli_prefix` (json_schema_extra) gives (`--replica-probe-s` for `replica.probe_s`).
The parsed flags build and validate the model, so a bad value is a usage error that
names the flag, never a traceback from deep inside a run.

Each default is stated once, in the model: the parser copies it (tools that read the
parser see it), and defaults built by a factory are left for the model to build.

Part of the contract (pydantic alone), so that `serve` and `train` build their command
lines the same way without either side importing the other.
"""

from __future__ import annotations

import argparse
import json
import types
import typing
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any, Literal, TypeVar

from pydantic import BaseModel, ValidationError
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined

M = TypeVar("M", bound=BaseModel)


def parse_value(text: str) -> Any:
    """A command-line value: JSON when it parses as JSON, else the string itself."""
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def parse_key_values(pairs: Iterable[str], flag: str) -> dict[str, Any]:
    """`KEY=VALUE` pairs into a dict; values as `parse_value`, dotted keys nest."""
    out: dict[str, Any] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise argparse.ArgumentTypeError(f"{flag} expects KEY=VALUE, got {pair!r}")
        *parents, leaf = key.split(".")
        node = out
        for part in parents:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise argparse.ArgumentTypeError(f"{flag}: {key!r} nests under a value")
        node[leaf] = parse_value(value)
    return out


def _extra(info: FieldInfo, key: str) -> str | None:
    extra = info.json_schema_extra if isinstance(info.json_schema_extra, dict) else {}
    value = extra.get(key)
    return str(value) if value else None


def flag_name(name: str, info: FieldInfo, prefix: str = "") -> str:
    """`--<prefix>field-name`, or the field's own `cli_flag` (json_schema_extra) if it
    names one."""
    return "--" + (_extra(info, "cli_flag") or prefix + name.replace("_", "-"))


def _nested(info: FieldInfo) -> tuple[type[BaseModel], str] | None:
    """(the model, its flags' prefix) of a field that nests a settings model."""
    prefix = _extra(info, "cli_prefix")
    annotation = info.annotation
    if prefix is None or not (isinstance(annotation, type) and issubclass(annotation, BaseModel)):
        return None
    return annotation, prefix


def _unwrap_optional(annotation: Any) -> Any:
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        if len(args) == 1:
            return args[0]
    return annotation


def _shown_default(info: FieldInfo) -> str:
    if info.default is PydanticUndefined:
        return "required" if info.default_factory is None else ""
    if info.default is None:
        return "default: none"
    if isinstance(info.default, bool):
        return f"default: {'on' if info.default else 'off'}"
    return f"default: {info.default}"


def add_sections(
    parser: argparse.ArgumentParser, sections: Mapping[str, Iterable[str]]
) -> dict[str, argparse._ArgumentGroup]:
    """Help sections for a model's flags: `sections` maps a title to the field paths it
    holds (dotted for a nested model's fields); the result maps each path to its section,
    and "" to the first (the fields no section names)."""
    out: dict[str, argparse._ArgumentGroup] = {}
    for i, (title, paths) in enumerate(sections.items()):
        group = parser.add_argument_group(title)
        if i == 0:
            out[""] = group
        out.update(dict.fromkeys(paths, group))
    return out


def add_model_arguments(
    parser: argparse.ArgumentParser | argparse._ArgumentGroup,
    model: type[BaseModel],
    *,
    skip: Iterable[str] = (),
    prefix: str = "",
    dest: str = "",
    sections: Mapping[str, argparse._ArgumentGroup] | None = None,
) -> None:
    """One flag per field of `model` (fields in `skip` are left to the caller), each in
    its help section where `sections` (from `add_sections`) is given."""
    skipped = set(skip)
    for name, info in model.model_fields.items():
        if name in skipped:
            continue
        if (nested := _nested(info)) is not None:
            add_model_arguments(
                parser, nested[0], prefix=nested[1], dest=f"{dest}{name}.", sections=sections
            )
            continue
        flag = flag_name(name, info, prefix)
        # A description that says what its unset default means shows that, not "none".
        shown = "" if "(default:" in (info.description or "") else _shown_default(info)
        help_text = " ".join(filter(None, [info.description, f"({shown})" if shown else ""]))
        # The parser's default is the model's, so tools reading the parser see the truth;
        # a default built by a factory (an environment variable, a fresh list) is left to
        # the model, and so is anything not given.
        default = argparse.SUPPRESS if info.default is PydanticUndefined else info.default
        kw: dict[str, Any] = {"dest": dest + name, "default": default, "help": help_text}
        if info.is_required():  # a missing one is a usage error at parse time, as usual
            kw["required"] = True
        annotation = _unwrap_optional(info.annotation)
        origin = typing.get_origin(annotation)
        args = typing.get_args(annotation)
        metavar = flag[2:].upper().replace("-", "_")
        if annotation is bool:
            kw["action"] = argparse.BooleanOptionalAction
        elif origin is Literal:
            kw.update(choices=list(args), type=type(args[0]))
        elif origin is list:
            item = args[0] if args and args[0] in (int, float, str, Path) else parse_value
            kw.update(action="append", type=item, metavar=metavar)
        elif origin is dict:
            kw.update(action="append", metavar="KEY=VALUE")
        elif origin is tuple:
            kw.update(nargs=len(args), type=args[0], metavar=metavar)
        elif annotation in (int, float, str, Path):
            kw.update(type=annotation, metavar=metavar)
        else:
            kw.update(type=parse_value, metavar=metavar)
        section = parser if sections is None else sections.get(dest + name, sections[""])
        section.add_argument(flag, **kw)


def model_from_args(
    parser: argparse.ArgumentParser, model: type[M], args: argparse.Namespace, **values: Any
) -> M:
    """Build `model` from the flags the user gave (plus `values`); a validation error
    exits through `parser.error`, naming the flag."""
    data = _values(parser, model, vars(args), "", "")
    data.update(values)
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        problems = []
        for err in exc.errors():
            where, rest = _flag_at(model, [str(part) for part in err["loc"]])
            problems.append(f"{where}{'.' + '.'.join(rest) if rest else ''}: {err['msg']}")
        parser.error("; ".join(problems))


def _values(
    parser: argparse.ArgumentParser,
    model: type[BaseModel],
    given: dict[str, Any],
    prefix: str,
    dest: str,
) -> dict[str, Any]:
    """The fields of `model` the flags gave, nested models as dicts of their own."""
    data: dict[str, Any] = {}
    for name, info in model.model_fields.items():
        if (nested := _nested(info)) is not None:
            data[name] = _values(parser, nested[0], given, nested[1], f"{dest}{name}.")
            continue
        if dest + name not in given:
            continue
        value = given[dest + name]
        if typing.get_origin(_unwrap_optional(info.annotation)) is dict:
            try:
                value = parse_key_values(value, flag_name(name, info, prefix))
            except argparse.ArgumentTypeError as exc:
                parser.error(str(exc))
        data[name] = value
    return data


def _flag_at(model: type[BaseModel], loc: list[str]) -> tuple[str, list[str]]:
    """The flag an error's location names, and the rest of the location past it."""
    prefix = ""
    while loc and (field := model.model_fields.get(loc[0])) is not None:
        nested = _nested(field)
        if nested is None or len(loc) == 1:
            return flag_name(loc[0], field, prefix), loc[1:]
        (model, prefix), loc = nested, loc[1:]
    return ".".join(loc), []


def command_line(
    settings: BaseModel, *, exclude: Iterable[str] = (), prefix: str = ""
) -> list[str]:
    """The flags that rebuild `settings` (the inverse of `add_model_arguments`): required
    fields always, others where they differ from the model's default. `exclude` leaves
    fields out (secrets: a printed command line lands in logs and shell history)."""
    skipped = set(exclude)
    args: list[str] = []
    for name, info in type(settings).model_fields.items():
        value = getattr(settings, name)
        if name in skipped or value is None:
            continue
        if (nested := _nested(info)) is not None:
            args += command_line(value, prefix=nested[1])
            continue
        if not info.is_required() and info.default_factory is None and value == info.default:
            continue
        flag = flag_name(name, info, prefix)
        if isinstance(value, bool):
            args.append(flag if value else "--no-" + flag[2:])
        elif isinstance(value, list):
            for item in value:
                args += [flag, str(item)]
        elif isinstance(value, tuple):
            args += [flag, *map(str, value)]
        else:
            args += [flag, str(value)]
    return args
