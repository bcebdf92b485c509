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

    def get_int(self, key: str, default: int, minimum: int = 1, maximum: int = 1 << 20) -> int:
        """Return an integer knob (bools are not integers here) in ``[minimum, maximum]``.

        Every knob has a ceiling: a job comes from the network, and one absurd width or
        depth would otherwise make whoever checks the job allocate (or loop) without end.
        """
        value = self._spec.options.get(key, default)
        if isinstance(value, bool) or not isinstance(value, int) or not minimum <= value <= maximum:
            raise self._error(key, f"an integer in [{minimum}, {maximum}]", value)
        return value

    def get_float(self, key: str, default: float, maximum: float = 1e6) -> float:
        """Return a number in ``(0, maximum]``; integers are accepted."""
        value = self._spec.options.get(key, default)
        if (
            isinstance(value, bool)
            or not isinstance(value, int | float)
            or not 0 < value <= maximum
        ):
            raise self._error(key, f"a number in (0, {maximum:g}]", value)
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
