"""One way to declare options: strict pydantic models, their errors, their CLI flags.

Every option set of the project (the model's shape, the training sections,
``prepare`` and ``probe`` options, job specs) is a :class:`StrictModel`: each
option is declared once, with its type, default, bounds and description, and

* unknown keys are refused with the full dotted name and a did-you-mean hint;
* a failed check raises the project's :class:`~elmo_service.errors.ConfigError`
  (or the model's ``error_class``) whose ``.field`` is the dotted name, which
  the HTTP layer turns into ``{code, message, field}``;
* :func:`add_arguments` derives ``argparse`` flags from the fields, so a flag's
  default is the model's default.
"""

from __future__ import annotations

import argparse
import difflib
import re
import types
import typing
from dataclasses import dataclass
from typing import Any, ClassVar, Literal, TypeVar

from pydantic import BaseModel, BeforeValidator, ConfigDict, ValidationError
from pydantic.fields import FieldInfo

from elmo_service.errors import ConfigError, ElmoServiceError, InputError

__all__ = [
    "Cli",
    "StrictModel",
    "Tuple",
    "add_arguments",
    "from_args",
    "need",
    "to_argv",
    "to_error",
]


M = TypeVar("M", bound="StrictModel")


def need(cond: bool, field: str, msg: str, error: type[ElmoServiceError] = ConfigError) -> None:
    """Raise ``error("field: msg", field=field)`` unless ``cond``.

    Inside a model validator the field is relative to that model; the error is
    re-raised with the full dotted name by :func:`to_error`.
    """
    if not cond:
        raise error(f"{field}: {msg}", field=field)


def _as_tuple(v: Any) -> Any:
    """YAML and JSON give lists; a tuple field takes them (item types are still checked)."""
    if isinstance(v, list | tuple):
        return tuple(_as_tuple(x) for x in v)
    return v


# ``Annotated[tuple[...], Tuple]``: a tuple option that YAML/JSON may give as a list
Tuple = BeforeValidator(_as_tuple)


@dataclass(frozen=True)
class Cli:
    """How a field appears on the command line, where the derived default does not fit.

    ``flag``: the option string (default ``--field-name``; ``--no-field-name`` for a
    bool that defaults to True); ``metavar``; ``positional``: an argument, not a flag.
    """

    flag: str | None = None
    metavar: str | None = None
    positional: bool = False


class StrictModel(BaseModel):
    """Unknown keys are errors; no coercion ("5" is not 5, but an int is a float); no
    infinite or NaN float (``lr: .inf`` would only fail steps later, as a NaN loss).

    Construction, :meth:`from_dict` and assignment raise ``error_class`` naming the
    dotted field, never pydantic's ValidationError.
    """

    model_config = ConfigDict(
        extra="forbid", strict=True, validate_assignment=True, allow_inf_nan=False
    )
    error_class: ClassVar[type[ElmoServiceError]] = ConfigError

    def __init__(self, **data: Any) -> None:
        try:
            super().__init__(**data)
        except ValidationError as e:
            raise to_error(e, type(self)) from e

    # pydantic's mark for an __init__ that only validates (as RootModel's): nested models are
    # then validated in one pass, so an error keeps its full path instead of going through here
    __init__.__pydantic_base_init__ = True  # type: ignore[attr-defined]

    def __setattr__(self, name: str, value: Any) -> None:
        try:
            super().__setattr__(name, value)
        except ValidationError as e:
            raise to_error(e, type(self)) from e

    @classmethod
    def from_dict(cls: type[M], d: Any, *, prefix: str = "") -> M:
        """Validate a plain dict (YAML, JSON); errors name ``prefix + dotted.field``."""
        if not isinstance(d, dict):
            where = prefix.rstrip(".") or "config"
            raise cls.error_class(f"{where}: expected a mapping, got {d!r}", field=where)
        try:
            return cls.model_validate(d)
        except ValidationError as e:
            raise to_error(e, cls, prefix) from e

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON types (tuples become lists)."""
        return self.model_dump(mode="json")

    def replace(self: M, **changes: Any) -> M:
        """A validated copy with ``changes`` (``model_copy`` does not validate)."""
        return type(self)(**{**dict(self), **changes})


# -- errors --------------------------------------------------------------------------------


def _unwrap(annotation: Any) -> Any:
    """``X | None`` -> ``X``; anything else unchanged."""
    args = typing.get_args(annotation)
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        rest = [a for a in args if a is not type(None)]
        if len(rest) == 1:
            return rest[0]
    return annotation


def _walk(model: type[BaseModel], loc: tuple) -> tuple[list[str], type[BaseModel] | None, Any]:
    """Follow ``loc`` through nested models: (field names, the model holding the last
    name, that field's FieldInfo or None). List indices are dropped from the name."""
    names: list[str] = []
    holder: type[BaseModel] | None = model
    info: FieldInfo | None = None
    current: Any = model
    for part in loc:
        if not isinstance(part, str):
            continue  # a list/tuple index
        if isinstance(current, type) and issubclass(current, BaseModel):
            holder, info = current, current.model_fields.get(part)
            names.append(part)
            current = _unwrap(info.annotation) if info is not None else None
        else:
            names.append(part)  # e.g. a key of a dict-typed field
            holder, info, current = None, None, None
    return names, holder, info


def _range(info: FieldInfo | None) -> str | None:
    """``must be positive`` / ``must be >= 1`` / ``must be in [0, 1)`` from a field's bounds."""
    if info is None:
        return None
    b: dict[str, Any] = {}
    for m in info.metadata:  # annotated_types' Gt(gt=0), Ge(ge=1)... as pydantic keeps them
        for key in ("gt", "ge", "lt", "le"):
            if getattr(m, key, None) is not None:
                b[key] = getattr(m, key)
    lo = ("(", b["gt"]) if "gt" in b else ("[", b["ge"]) if "ge" in b else None
    hi = (")", b["lt"]) if "lt" in b else ("]", b["le"]) if "le" in b else None
    if lo and hi:
        return f"must be in {lo[0]}{lo[1]}, {hi[1]}{hi[0]}"
    if lo:
        return (
            "must be positive"
            if lo == ("(", 0)
            else f"must be {'>' if lo[0] == '(' else '>='} {lo[1]}"
        )
    if hi:
        return f"must be {'<' if hi[0] == ')' else '<='} {hi[1]}"
    return None


_TYPE_NAMES = {
    "int": "int",
    "float": "float",
    "bool": "bool",
    "string": "str",
    "tuple": "a list",
    "list": "a list",
    "dict": "a mapping",
    "model": "a mapping",
    "model_attributes": "a mapping",
}


def _message(err: dict[str, Any], info: FieldInfo | None) -> str:
    typ, ctx, value = err.get("type", ""), err.get("ctx") or {}, err.get("input")
    at_field = not err.get("loc") or isinstance(err["loc"][-1], str)
    kind = typ.removesuffix("_type").removesuffix("_parsing").removesuffix("_from_float")
    if kind in _TYPE_NAMES and typ != kind:
        return f"expected {_TYPE_NAMES[kind]}, got {value!r}"
    if typ == "literal_error":
        return f"expected {ctx.get('expected')}, got {value!r}"
    if typ in ("greater_than", "greater_than_equal", "less_than", "less_than_equal"):
        return _range(info) or err.get("msg", "out of range")
    if typ == "too_long" and "max_length" in ctx:
        return f"expected at most {ctx['max_length']} items, got {list(value)!r}"
    if typ == "too_short" and "min_length" in ctx:
        return f"expected at least {ctx['min_length']} items, got {list(value)!r}"
    if typ == "missing":
        # a fixed-size tuple that is too short reports its first missing item
        return "required" if at_field else f"too few items, got {list(value)!r}"
    return str(err.get("msg", "invalid value")).removeprefix("Value error, ")


def to_error(
    e: ValidationError, model: type[BaseModel], prefix: str = "", error: type | None = None
) -> ElmoServiceError:
    """pydantic's first error (unknown keys first) as the project's error with a dotted ``field``.

    ``prefix`` (e.g. ``"config."``) is put before every field name.
    """
    error = error or getattr(model, "error_class", ConfigError)
    errors = sorted(e.errors(include_url=False), key=lambda x: x.get("type") != "extra_forbidden")
    if not errors:
        return error(str(e), field=prefix.rstrip(".") or None)
    err = errors[0]
    names, holder, info = _walk(model, tuple(err.get("loc", ())))
    inner = (err.get("ctx") or {}).get("error")
    if isinstance(inner, ElmoServiceError):
        # raised by a validator with a field relative to its model: make it absolute
        if inner.field:
            names.append(inner.field)
        field = prefix + ".".join(names) if names else prefix.rstrip(".") or None
        rel = f"{inner.field}: " if inner.field else ""
        return error(f"{field}: {inner.message.removeprefix(rel)}", field=field)
    field = prefix + ".".join(names) if names else prefix.rstrip(".") or None
    if err.get("type") == "extra_forbidden":
        known = sorted(holder.model_fields) if holder is not None else []
        close = difflib.get_close_matches(names[-1] if names else "", known, n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        return error(
            f"unknown config key {field!r}{hint}; known here: {', '.join(known)}", field=field
        )
    msg = _message(err, info)
    more = len(errors) - 1
    if more:
        msg += f" (and {more} more error{'s' if more > 1 else ''})"
    return error(f"{field}: {msg}" if field else msg, field=field)


# -- command-line flags --------------------------------------------------------------------


def _cli(info: FieldInfo) -> Cli:
    return next((m for m in info.metadata if isinstance(m, Cli)), Cli())


def _flag(name: str, info: FieldInfo) -> str:
    """``--vocab-size`` for ``vocab_size``; ``--no-dedupe`` for a bool that defaults to True."""
    cli = _cli(info)
    if cli.flag:
        return cli.flag
    on = _unwrap(info.annotation) is bool and info.get_default(call_default_factory=True)
    return ("--no-" if on else "--") + name.replace("_", "-")


def add_arguments(
    parser: argparse.ArgumentParser | argparse._ArgumentGroup,
    model: type[BaseModel],
    fields: typing.Iterable[str] | None = None,
    *,
    deferred: typing.Mapping[str, str] | None = None,
) -> list[str]:
    """Add one flag per field of ``model`` (all, or ``fields``); returns the field names.

    The flag's type, choices, default and help come from the field: ``--vocab-size``
    for ``vocab_size``; a bool defaulting to False is ``--name`` (store_true), one
    defaulting to True is ``--no-name`` (store_false); a list is ``nargs="+"``; a
    ``Literal`` gives choices; a required field is a required flag (or a positional
    argument, with ``Cli(positional=True)``). ``args.<field>`` holds the value.

    ``deferred``: fields whose default the command decides later (e.g. per task kind):
    their flag defaults to None and the help says ``(default: TEXT)``.
    """
    deferred = deferred or {}
    names = list(fields) if fields is not None else list(model.model_fields)
    for name in names:
        info = model.model_fields[name]
        cli = _cli(info)
        tp = _unwrap(info.annotation)
        required = info.is_required()
        default = (
            None if required or name in deferred else info.get_default(call_default_factory=True)
        )
        help_ = (info.description or "").replace("%", "%%")  # argparse formats help with %
        kw: dict[str, Any] = {"help": help_}
        if tp is bool:
            flag = _flag(name, info)
            if default:  # the flag turns the option off
                kw["help"] = f"turn off (default on): {help_}" if help_ else None
            kw.update(action="store_false" if default else "store_true", dest=name)
            parser.add_argument(flag, **kw)
            continue
        if typing.get_origin(tp) is Literal:
            choices = list(typing.get_args(tp))
            kw.update(choices=choices, type=type(choices[0]))
        elif typing.get_origin(tp) in (list, tuple):
            kw.update(nargs="+", type=typing.get_args(tp)[0])
        elif tp in (int, float, str):
            kw["type"] = tp
        else:
            raise TypeError(f"{model.__name__}.{name}: no command-line form for {tp}")
        if cli.metavar:
            kw["metavar"] = cli.metavar
        if cli.positional:
            if not required:
                kw.setdefault("nargs", "?")
                kw["default"] = default
            parser.add_argument(name, **kw)
            continue
        shown = deferred.get(name, default)
        if shown is not None and not isinstance(shown, list | tuple):
            kw["help"] = f"{help_} (default: {shown})".lstrip()
        if required:
            kw["required"] = True
        else:
            kw["default"] = default
        parser.add_argument(_flag(name, info), dest=name, **kw)
    return names


def to_argv(obj: BaseModel, fields: typing.Iterable[str] | None = None) -> list[str]:
    """The flags that :func:`add_arguments` would parse back into ``obj`` (its inverse)."""
    model = type(obj)
    out: list[str] = []
    for name in fields if fields is not None else model.model_fields:
        info, value = model.model_fields[name], getattr(obj, name)
        if _unwrap(info.annotation) is bool:
            if value != info.get_default(call_default_factory=True):
                out.append(_flag(name, info))
            continue
        if value is None or (isinstance(value, list | tuple) and not value):
            continue
        items = [str(v) for v in value] if isinstance(value, list | tuple) else [str(value)]
        out += items if _cli(info).positional else [_flag(name, info), *items]
    return out


def from_args(model: type[StrictModel], args: argparse.Namespace, **extra: Any) -> Any:
    """``model`` from the parsed flags that :func:`add_arguments` added (plus ``extra``)."""
    values = {n: getattr(args, n) for n in model.model_fields if hasattr(args, n)}
    return model(**{**values, **extra})


# ------------------------------------------------------------------ names users give
# A model name is a folder name inside the models folder, a URL segment and a cache/task
# namespace: a whitelist, so NUL, separators, '..', hidden names and control characters
# never reach the filesystem (where NUL raises ValueError deep inside os.path).
MODEL_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")


def check_model_name(name: object, field: str = "name") -> str:
    """``name`` if it is a valid model (artifact folder) name; InputError naming ``field``.

    Every model name that comes from a user goes through here: ``ELMO_MODEL``,
    ``POST /v1/models/{name}/activate`` and a job's artifact ``name``.
    """
    if not isinstance(name, str) or not MODEL_NAME.fullmatch(name):
        raise InputError(
            f"{field}: {name!r} is not a model name: 1-64 characters, letters, digits, "
            "'.', '_', '-', starting with a letter or digit",
            field=field,
        )
    return name
