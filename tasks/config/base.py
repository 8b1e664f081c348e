"""The base of every config section and the config error type."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class ConfigError(ValueError):
    """A config problem, with the offending dotted key in the message."""


class _Section(BaseModel):
    # allow_inf_nan=False: inf and nan are refused for every float key (grpo.learning_rate=.inf would otherwise pass
    # and fail a step later inside torch, naming no key)
    model_config = ConfigDict(extra="forbid", frozen=True, validate_default=True, allow_inf_nan=False)
