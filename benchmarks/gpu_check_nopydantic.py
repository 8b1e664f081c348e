"""Just enough of pydantic's class API for grpoflow's config sections to be defined and built where pydantic is not
installed (the GPU machine of benchmarks/gpu_check.py has torch, transformers, peft and triton only).

grpoflow's trainer, model and reward modules import their settings classes from grpoflow.tasks.config (GRPOConfig,
LoraConfig, TinyModelConfig, DEVICE_PATTERN, ...), which are pydantic models. Rather than copy those classes (and
their defaults, which would drift), the check installs this module as ``pydantic`` when the real one is missing, so
the real classes are defined from their own source: fields with their defaults and default factories, validation
aliases, field and model validators (before and after, with ``info.context``), ``extra="forbid"`` (an unknown key
raises), frozen instances, ``model_dump``, ``model_copy`` and ``model_validate``. What it does not do is validate
types and bounds (``ge``, ``Literal``, ...): the check builds its configs from fixed, known-good values. An int given
to a field annotated ``float`` becomes a float, as pydantic makes it (config hashes are JSON of the dump).

tests/test_gpu_check.py checks that GRPOConfig built here dumps exactly what real pydantic's does.
"""

from __future__ import annotations

import copy
import importlib.machinery
import inspect
import sys
import types
from typing import Any

_MISSING = object()


class ValidationError(ValueError):
    pass


class AliasChoices:
    def __init__(self, *choices: str):
        self.choices = choices


class ValidationInfo:
    def __init__(self, context: dict | None = None, data: dict | None = None):
        self.context = context
        self.data = data or {}


def ConfigDict(**kw) -> dict:  # noqa: N802 (pydantic's name)
    return dict(kw)


class FieldInfo:
    def __init__(self, default=_MISSING, *, default_factory=None, validation_alias=None, alias=None, **_constraints):
        self.default = default
        self.default_factory = default_factory
        self.aliases = validation_alias.choices if isinstance(validation_alias, AliasChoices) else ()
        if isinstance(validation_alias, str):
            self.aliases = (validation_alias,)
        if alias:
            self.aliases = (alias, *self.aliases)

    def make_default(self):
        if self.default_factory is not None:
            return self.default_factory()
        if self.default is _MISSING:
            raise _MissingValue
        return copy.deepcopy(self.default)


class _MissingValue(Exception):
    pass


def Field(default=_MISSING, **kw) -> Any:  # noqa: N802
    return FieldInfo(default, **kw)


class _Validator:
    """What field_validator/model_validator leave in a class body until BaseModel's __init_subclass__ collects it."""

    def __init__(self, func, kind: str, mode: str, fields: tuple[str, ...] = ()):
        self.func, self.kind, self.mode, self.fields = func, kind, mode, fields


def field_validator(*fields: str, mode: str = "after"):
    return lambda func: _Validator(func, "field", mode, fields)


def model_validator(*, mode: str):
    return lambda func: _Validator(func, "model", mode)


def _call(fn, *args, info: ValidationInfo):
    """Call a validator with ``info`` when it takes one more argument than ``args``."""
    n = len(inspect.signature(fn).parameters)
    return fn(*args, info) if n > len(args) else fn(*args)


class BaseModel:
    model_config: dict = {}
    model_fields: dict[str, FieldInfo] = {}
    _annotations: dict[str, str] = {}
    _validators: list[tuple[str, _Validator]] = []

    def __init_subclass__(cls, **kw):
        super().__init_subclass__(**kw)
        fields = dict(getattr(cls, "model_fields", {}))
        notes = dict(getattr(cls, "_annotations", {}))
        validators = list(getattr(cls, "_validators", []))
        for name, note in inspect.get_annotations(cls).items():
            if name.startswith("_") or name == "model_config" or "ClassVar" in str(note):
                continue
            value = cls.__dict__.get(name, _MISSING)
            fields[name] = value if isinstance(value, FieldInfo) else FieldInfo(value)
            notes[name] = str(note)
        for name, value in list(cls.__dict__.items()):
            if isinstance(value, _Validator):
                validators = [(n, v) for n, v in validators if n != name] + [(name, value)]
                setattr(cls, name, value.func)  # still callable as the method it decorates
        cls.model_fields, cls._annotations, cls._validators = fields, notes, validators
        config = {}
        for base in reversed(cls.__mro__):
            config.update(base.__dict__.get("model_config", {}))
        cls.model_config = config

    def __init__(self, **data):
        self._build(data, None)

    def _build(self, data: dict, context: dict | None) -> None:
        cls, info = type(self), ValidationInfo(context)
        for name, v in cls._validators:
            if v.kind == "model" and v.mode == "before":
                data = _call(getattr(cls, name), data, info=info)
        data = dict(data)
        for name, f in cls.model_fields.items():  # an alias given instead of the name
            for alias in f.aliases:
                if alias != name and alias in data:
                    data.setdefault(name, data.pop(alias))
        unknown = set(data) - set(cls.model_fields)
        if unknown and cls.model_config.get("extra") == "forbid":
            raise ValidationError(f"{cls.__name__}: unknown keys {sorted(unknown)}")
        for name, f in cls.model_fields.items():
            try:
                value = data[name] if name in data else f.make_default()
            except _MissingValue:
                raise ValidationError(f"{cls.__name__}.{name}: field required") from None
            value = self._coerce(name, f, value)
            for vname, v in cls._validators:
                if v.kind == "field" and name in v.fields:
                    try:
                        value = _call(getattr(cls, vname), value, info=info)
                    except ValueError as e:  # named by its key, as pydantic's errors are
                        raise ValidationError(f"{cls.__name__}.{name}: {e}") from e
            object.__setattr__(self, name, value)
            info.data[name] = value
        for vname, v in cls._validators:
            if v.kind == "model" and v.mode == "after":
                _call(getattr(self, vname), info=info)

    def _coerce(self, name: str, f: FieldInfo, value):
        note = type(self)._annotations.get(name, "")
        if note == "float" and isinstance(value, int) and not isinstance(value, bool):
            return float(value)
        default = f.default_factory if f.default_factory is not None else f.default
        if isinstance(value, dict) and isinstance(default, type) and issubclass(default, BaseModel):
            return default(**value)  # a nested section given as a mapping
        if isinstance(value, dict) and isinstance(default, BaseModel):
            return type(default)(**value)
        return value

    def __setattr__(self, name, value):
        if type(self).model_config.get("frozen"):
            raise ValidationError(f"{type(self).__name__} is frozen: {name} cannot be set")
        object.__setattr__(self, name, value)

    @classmethod
    def model_validate(cls, obj: dict, *, context: dict | None = None):
        self = cls.__new__(cls)
        self._build(dict(obj), context)
        return self

    def model_dump(self, *, mode: str = "python", exclude: set[str] | None = None) -> dict:
        def dump(v):
            if isinstance(v, BaseModel):
                return v.model_dump(mode=mode)
            if isinstance(v, (list, tuple)):
                return [dump(x) for x in v] if mode == "json" or isinstance(v, list) else tuple(dump(x) for x in v)
            if isinstance(v, dict):
                return {k: dump(x) for k, x in v.items()}
            return v

        return {n: dump(getattr(self, n)) for n in type(self).model_fields if n not in (exclude or ())}

    def model_copy(self, *, update: dict | None = None):
        new = copy.copy(self)
        for k, v in (update or {}).items():
            object.__setattr__(new, k, v)
        return new

    def __eq__(self, other):
        return type(other) is type(self) and self.model_dump() == other.model_dump()

    def __hash__(self):
        return hash(repr(self))

    def __repr__(self):
        args = ", ".join(f"{k}={getattr(self, k)!r}" for k in type(self).model_fields)
        return f"{type(self).__name__}({args})"


def install() -> bool:
    """Make ``import pydantic`` give this module when the real pydantic does not import; True when installed."""
    try:
        import pydantic  # noqa: F401

        return False
    except ImportError:
        pass
    mod = sys.modules[__name__]
    stand_in = types.ModuleType("pydantic", __doc__)
    stand_in.__spec__ = importlib.machinery.ModuleSpec("pydantic", None)
    for name in (
        "AliasChoices",
        "BaseModel",
        "ConfigDict",
        "Field",
        "FieldInfo",
        "ValidationError",
        "ValidationInfo",
        "field_validator",
        "model_validator",
    ):
        setattr(stand_in, name, getattr(mod, name))
    stand_in.GPU_CHECK_STAND_IN = True
    sys.modules["pydantic"] = stand_in
    return True
