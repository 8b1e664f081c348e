"""The configuration reference (docs/configuration.md), generated from the pydantic sections of the run config.

``python -m grpoflow.tasks.config.reference > docs/configuration.md`` writes it: one section per config section,
its intro from the section class's docstring, then one row per key with its type, default, allowed values (Literal
choices and bounds), the names it is also accepted under (pydantic aliases, the TRL ``GRPOConfig`` names of a
``trl:`` section) and the Field's description. Deterministic: the same models give the same text, byte for byte.
"""

from __future__ import annotations

import json
import re
import types
import typing
from collections.abc import Iterator
from typing import Any, Literal

from pydantic import AliasChoices, BaseModel
from pydantic.fields import FieldInfo

from grpoflow.tasks.config.pipeline import PipelineConfig
from grpoflow.tasks.config.trl_keys import TRL_KEYS, markdown_table

COMMAND = "python -m grpoflow.tasks.config.reference > docs/configuration.md"

INTRO = f"""# Configuration reference

<!-- Generated from the pydantic models in tasks/config/ by `{COMMAND}`; do not edit by hand. -->

A run is configured by one YAML file of the sections below (`configs/default.yaml` is the default; any packaged
config can be named without its folder, e.g. `grpoflow run gsm8k-qwen2.5-0.5b`) plus `key=value` overrides on the
command line, whose values are parsed as YAML: `grpoflow run default grpo.beta=0.04 "grpo.reward_funcs=[correctness]"`.
Every key is validated before anything runs: an unknown key, a wrong type, a value outside its allowed values or
an impossible combination fails with an error that names the dotted key.

Columns: **Default** is the value when the key is absent (JSON, which YAML accepts as is); **Allowed** lists the
choices or bounds the key is checked against; **Also** lists other names the key is accepted under: an alias in
the same section, or `trl: name`, the TRL `GRPOConfig` name that a `trl:` section (below) maps onto the key.
"""


def sections(model: type[BaseModel] = PipelineConfig, prefix: str = "") -> Iterator[tuple[str, type[BaseModel]]]:
    """(dotted name, section class) of every section under ``model``, depth first in field order."""
    for name, field in model.model_fields.items():
        sub = _section_class(field)
        if sub is not None:
            dotted = f"{prefix}{name}"
            yield dotted, sub
            yield from sections(sub, f"{dotted}.")


def _section_class(field: FieldInfo) -> type[BaseModel] | None:
    ann = field.annotation
    return ann if isinstance(ann, type) and issubclass(ann, BaseModel) else None


def keys(model: type[BaseModel], prefix: str) -> Iterator[tuple[str, FieldInfo]]:
    """(dotted key, field) of the section's own keys (not its subsections)."""
    for name, field in model.model_fields.items():
        if _section_class(field) is None:
            yield f"{prefix}.{name}", field


def type_name(ann: Any) -> str:
    """A YAML reader's name for an annotation: Literal -> the type of its values, Optional -> `| null`."""
    origin, args = typing.get_origin(ann), typing.get_args(ann)
    if ann is type(None):
        return "null"
    if origin is Literal:
        return " | ".join(dict.fromkeys(type_name(type(a)) for a in args))
    if origin in (typing.Union, types.UnionType):
        return " | ".join(type_name(a) for a in args)
    if origin is list:
        return f"list[{type_name(args[0])}]"
    if origin is dict:
        return f"dict[{type_name(args[0])}, {type_name(args[1])}]"
    return getattr(ann, "__name__", str(ann))


def _literals(ann: Any) -> tuple[list[Any], bool]:
    """The Literal choices in ``ann`` and whether they apply to each item of a list."""
    origin, args = typing.get_origin(ann), typing.get_args(ann)
    if origin is Literal:
        return list(args), False
    if origin is list:
        return _literals(args[0])[0], True
    if origin in (typing.Union, types.UnionType):
        for a in args:
            found, each = _literals(a)
            if found:
                return found, each
    return [], False


_BOUNDS = (("ge", ">="), ("gt", ">"), ("le", "<="), ("lt", "<"))  # the attributes of annotated_types' Ge, Gt...


def allowed(field: FieldInfo) -> str:
    """The field's choices and bounds, e.g. "one of `grpo`, `dapo`" or ">= 0, < 1"."""
    parts = []
    choices, each = _literals(field.annotation)
    if choices:
        parts.append(("each of " if each else "one of ") + ", ".join(f"`{_value(c)}`" for c in choices))
    for meta in field.metadata:
        for attr, sign in _BOUNDS:
            if getattr(meta, attr, None) is not None:
                parts.append(f"{sign} {getattr(meta, attr)}")
        if getattr(meta, "min_length", None) is not None:
            parts.append(f"at least {meta.min_length} {'item' if _is_list(field) else 'character'}")
        if getattr(meta, "pattern", None):
            parts.append(f"matches `{meta.pattern}`")
    return ", ".join(parts)


def _is_list(field: FieldInfo) -> bool:
    return typing.get_origin(field.annotation) is list


def _value(v: Any) -> str:
    return v if isinstance(v, str) else json.dumps(v)


def default(field: FieldInfo) -> str:
    return json.dumps(field.get_default(call_default_factory=True))


def trl_names() -> dict[str, list[str]]:
    """Our dotted key -> the TRL GRPOConfig keys that map onto it (trl_keys.TRL_KEYS, the "maps" rules)."""
    found: dict[str, list[str]] = {}
    for trl_key, rule in TRL_KEYS.items():
        if rule.kind == "maps":
            for target in re.findall(r"`([a-z0-9_]+\.[a-z0-9_.]+)", rule.what):
                found.setdefault(target, []).append(trl_key)
    return found


def also(dotted: str, field: FieldInfo, trl: dict[str, list[str]]) -> str:
    names = []
    if isinstance(field.validation_alias, AliasChoices):
        own = dotted.rsplit(".", 1)[1]
        names += [f"`{c}`" for c in field.validation_alias.choices if isinstance(c, str) and c != own]
    names += [f"`trl: {t}`" for t in trl.get(dotted, [])]
    return ", ".join(names)


def intro(cls: type[BaseModel]) -> str:
    """The section class's own docstring as Markdown (RST roles and double backticks made plain)."""
    doc = cls.__dict__.get("__doc__") or ""
    doc = re.sub(r":\w+:`~?", "`", doc).replace("``", "`")
    paragraphs = [" ".join(p.split()) for p in re.split(r"\n\s*\n", doc.strip())]
    return "\n\n".join(p for p in paragraphs if p)


def _cell(text: str) -> str:
    """One table cell: one line, pipes escaped, and outside code spans ``<`` and ``>`` as entities (else Markdown
    reads ``<output_dir>`` as an HTML tag and shows nothing)."""
    spans = " ".join(text.split()).replace("|", "\\|").split("`")
    spans[::2] = [s.replace("<", "&lt;").replace(">", "&gt;") for s in spans[::2]]
    return "`".join(spans)


def section_text(dotted: str, cls: type[BaseModel], trl: dict[str, list[str]]) -> str:
    lines = [f"## `{dotted}`", ""]
    if text := intro(cls):
        lines += [text, ""]
    rows = list(keys(cls, dotted))
    if rows:
        lines += ["| Key | Type | Default | Allowed | Also | Description |", "|---|---|---|---|---|---|"]
        for key, field in rows:
            cells = [f"`{key}`", f"`{type_name(field.annotation)}`", f"`{default(field)}`", allowed(field)]
            cells += [also(key, field, trl), field.description or ""]
            lines.append("| " + " | ".join(_cell(c) for c in cells) + " |")
        lines.append("")
    subs = [name for name, _ in sections(cls, f"{dotted}.") if name.count(".") == dotted.count(".") + 1]
    if subs:
        lines += ["Subsections: " + ", ".join(f"[`{s}`](#{s.replace('.', '')})" for s in subs) + ".", ""]
    return "\n".join(lines)


TRL_INTRO = """## `trl`

A `trl:` section takes TRL 1.16 `GRPOConfig` keys verbatim (a TRL config file can also be added with
`--trl-config`). Each key either maps onto one of the keys above, is accepted with a warning because it has no
meaning here, or is accepted only at the value that asks for what grpoflow does. A `trl:` key and a key of ours
that set the same thing to different values are refused, naming both.
"""


def missing_descriptions() -> list[str]:
    """Dotted keys whose Field has no description."""
    return [k for name, cls in sections() for k, f in keys(cls, name) if not (f.description or "").strip()]


def render() -> str:
    trl = trl_names()
    parts = [INTRO] + [section_text(name, cls, trl) for name, cls in sections()]
    parts.append(TRL_INTRO + "\n" + markdown_table() + "\n")
    return "\n".join(parts)


if __name__ == "__main__":
    print(render(), end="")
