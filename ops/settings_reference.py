"""The reference of every ``FLYWHEEL_*`` setting, generated from the settings classes
(``flywheel settings --markdown`` writes docs/settings.md; a test fails when the file and the code
differ).

Invariant: what the reference says is read from the classes themselves: the variable's name from
the class's ``env_prefix`` and the field, the type from its annotation, the default from the field,
the bounds from its constraints, the meaning from ``Field(description=...)`` or, failing that, the
attribute docstring under the field. Every ``BaseSettings`` subclass defined in
:data:`SETTINGS_MODULES` is listed; ``tests/unit/test_settings_reference.py`` fails when a settings
class is defined in a module this list lacks.
"""

from __future__ import annotations

import ast
import enum
import importlib
import inspect
import textwrap
import types
import typing
from dataclasses import dataclass
from pathlib import Path

from pydantic import SecretStr
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined
from pydantic_settings import BaseSettings

# Modules that define settings classes, in the order the reference lists them.
SETTINGS_MODULES = (
    "producers.settings",
    "app.core.settings",
    "consumers.settings",
    "evals.config",
    "evals.harness.sandbox_host",
    "app.lifecycle.release",
    "serving.canary_server",
    "serving.front",
)

# Variables read from the environment directly, outside any settings class: (name, type, default, meaning).
PROCESS_VARIABLES = (
    (
        "FLYWHEEL_HOME",
        "path",
        "the user data directory (platformdirs: `~/.local/share/flywheel` on Linux)",
        "where local state lives: the embedded stack's data and `stack.env`, checkpoints, reports, logs, "
        "the producer's spool. A relative path resolves under the current directory: `FLYWHEEL_HOME=.flywheel` "
        "keeps a checkout's state beside it.",
    ),
    (
        "FLYWHEEL_DATA_DIR",
        "path",
        "`$XDG_CACHE_HOME/flywheel` (`~/.cache/flywheel`)",
        "where downloaded data and materialized models are cached, shared across homes.",
    ),
)


@dataclass(frozen=True)
class SettingDoc:
    """One environment variable: its name, type, default and meaning, as the reference prints them."""

    variable: str
    type: str
    default: str
    meaning: str
    owner: str  # module.Class that reads it


def settings_classes() -> list[type[BaseSettings]]:
    """Every ``BaseSettings`` subclass defined in :data:`SETTINGS_MODULES` with an ``env_prefix``,
    in module order, then source order."""
    found: list[type[BaseSettings]] = []
    for name in SETTINGS_MODULES:
        module = importlib.import_module(name)
        classes = [
            obj
            for obj in vars(module).values()
            if inspect.isclass(obj)
            and issubclass(obj, BaseSettings)
            and obj.__module__ == name
            and obj.model_config.get("env_prefix")
        ]
        found += sorted(classes, key=lambda c: inspect.getsourcelines(c)[1])
    return found


def _attribute_docstrings(cls: type) -> dict[str, str]:
    """Field name -> the string literal right under its annotated assignment (PEP 257's attribute docstring)."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    body = tree.body[0].body  # type: ignore[attr-defined]
    docs: dict[str, str] = {}
    for node, after in zip(body, body[1:], strict=False):
        if (
            isinstance(node, ast.AnnAssign)
            and isinstance(node.target, ast.Name)
            and isinstance(after, ast.Expr)
            and isinstance(after.value, ast.Constant)
            and isinstance(after.value.value, str)
        ):
            docs[node.target.id] = inspect.cleandoc(after.value.value)
    return docs


def _type_name(annotation: object) -> str:
    """``str | None`` -> ``str, optional``; ``Literal["a", "b"]`` -> ``a | b``; classes by name."""
    origin = typing.get_origin(annotation)
    if origin is typing.Literal:
        return " \\| ".join(str(v) for v in typing.get_args(annotation))
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        inner = ", ".join(_type_name(a) for a in args)
        return f"{inner}, optional" if len(args) < len(typing.get_args(annotation)) else inner
    if origin is not None:
        return f"{getattr(origin, '__name__', str(origin))}[{', '.join(_type_name(a) for a in typing.get_args(annotation))}]"
    if annotation is SecretStr:
        return "secret"
    if annotation is Path:
        return "path"
    return getattr(annotation, "__name__", str(annotation))


def _default(field: FieldInfo) -> str:
    if field.default_factory is not None:
        value = field.default_factory()  # type: ignore[call-arg]
    elif field.default is PydanticUndefined:
        return "required"
    else:
        value = field.default
    if value is None:
        return "unset"
    if isinstance(value, SecretStr):
        return "(secret)"
    if isinstance(value, enum.Enum):
        value = value.value
    if isinstance(value, tuple | list):
        return "`" + ",".join(str(v) for v in value) + "`"
    return f"`{value}`"


def _bounds(field: FieldInfo) -> str:
    parts = []
    for meta in field.metadata:
        for attr, sign in (("ge", ">="), ("gt", ">"), ("le", "<="), ("lt", "<"), ("pattern", "matches")):
            value = getattr(meta, attr, None)
            if value is not None:
                parts.append(f"{sign} `{value}`" if attr == "pattern" else f"{sign} {value}")
    return "; ".join(parts)


def setting_docs() -> list[SettingDoc]:
    """Every variable of every settings class (see the module invariant)."""
    docs: list[SettingDoc] = []
    for cls in settings_classes():
        prefix = cls.model_config["env_prefix"]
        attribute_docs: dict[str, str] = {}
        for klass in reversed(cls.__mro__):  # a subclass's docstring wins
            if klass is not object and issubclass(klass, BaseSettings) and klass is not BaseSettings:
                attribute_docs.update(_attribute_docstrings(klass))
        for name, field in cls.model_fields.items():
            meaning = (field.description or attribute_docs.get(name) or "").strip()
            bounds = _bounds(field)
            docs.append(
                SettingDoc(
                    variable=(prefix + name).upper(),
                    type=_type_name(field.annotation) + (f" ({bounds})" if bounds else ""),
                    default=_default(field),
                    meaning=" ".join(meaning.split()),
                    owner=f"{cls.__module__}.{cls.__qualname__}",
                )
            )
    return docs


def _cell(text: str) -> str:
    return text.replace("|", "\\|") if "\\|" not in text else text


def render_markdown() -> str:
    """docs/settings.md: a table per settings class, the process variables first."""
    lines = [
        "# Settings reference",
        "",
        "<!-- Generated by `flywheel settings --markdown > docs/settings.md` from the settings classes;",
        "     tests/unit/test_settings_reference.py fails when this file and the code differ. Edit the",
        "     classes' field descriptions, not this file. -->",
        "",
        "Every setting is an environment variable. Resolution order (highest first): the process's",
        "environment, then `$FLYWHEEL_HOME/stack.env` (written by `flywheel stack up`), then the default.",
        "Types: `optional` means the variable may be left unset; `secret` values are never logged.",
        "",
        "## Process",
        "",
        "| variable | type | default | meaning |",
        "|---|---|---|---|",
    ]
    lines += [f"| `{v}` | {t} | {d} | {_cell(m)} |" for v, t, d, m in PROCESS_VARIABLES]
    owner = None
    for doc in setting_docs():
        if doc.owner != owner:
            owner = doc.owner
            module, _, cls = owner.rpartition(".")
            summary = inspect.getdoc(getattr(importlib.import_module(module), cls)) or ""
            lines += [
                "",
                f"## {cls} (`{module}`)",
                "",
                " ".join(summary.split("\n\n")[0].split()),
                "",
                "| variable | type | default | meaning |",
                "|---|---|---|---|",
            ]
        lines.append(f"| `{doc.variable}` | {_cell(doc.type)} | {_cell(doc.default)} | {_cell(doc.meaning) or '-'} |")
    return "\n".join(lines) + "\n"
