"""Typed access to `ModelSpec.options`, with errors that name the model and the knob."""

from common.errors import ConfigError
from common.zoo._types import ModelSpec, OptionValue

__all__ = ["Options"]


class Options:
    """Read a spec's options, rejecting unknown keys and values of the wrong type.

    Each builder lists the knobs it understands up front so that a misspelt option
    fails at build time instead of silently training the default model.
    """

    def __init__(self, spec: ModelSpec, known: frozenset[str] | set[str]) -> None:
        unknown = sorted(set(spec.options) - set(known))
        if unknown:
            accepted = ", ".join(sorted(known)) or "none"
            raise ConfigError(
                f"model {spec.name!r}: unknown options {unknown}; accepted options: {accepted}"
            )
        self._spec = spec

    def _error(self, key: str, expected: str, value: OptionValue) -> ConfigError:
        return ConfigError(
            f"model {self._spec.name!r}: options.{key} must be {expected}, got {value!r}"
        )

    def has(self, key: str) -> bool:
        """Tell whether the spec sets ``key`` explicitly."""
        return key in self._spec.options

    def get_int(self, key: str, default: int, minimum: int = 1) -> int:
        """Return an integer knob (bools are not integers here) of at least ``minimum``."""
        value = self._spec.options.get(key, default)
        if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
            raise self._error(key, f"an integer >= {minimum}", value)
        return value

    def get_float(self, key: str, default: float) -> float:
        """Return a strictly positive number; integers are accepted."""
        value = self._spec.options.get(key, default)
        if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
            raise self._error(key, "a number > 0", value)
        return float(value)

    def get_str(self, key: str, default: str) -> str:
        """Return a string knob."""
        value = self._spec.options.get(key, default)
        if not isinstance(value, str):
            raise self._error(key, "a string", value)
        return value

    def get_raw(self, key: str, default: OptionValue) -> OptionValue:
        """Return a knob as given, for options that accept several forms."""
        return self._spec.options.get(key, default)

    def error(self, key: str, expected: str, value: OptionValue) -> ConfigError:
        """Build the standard error for a knob that failed a custom check."""
        return self._error(key, expected, value)
