"""User models named ``"package.module:factory"``.

The module declares which of its callables are factories with `model_factory`; a job
naming any other attribute (a helper such as ``clear_cache``) is refused without it
being called. The factory takes no arguments and returns either a `ZooModel` (full
control over the input description) or an ``nn.Sequential`` / list / tuple of modules,
each module one layer. For the latter the input is described by options, defaulting to
CIFAR images:

- ``input_kind``: ``"image"`` (default) or ``"tokens"``;
- ``input_shape``: per-sample shape as ``"3x32x32"`` or a single int such as ``64``;
  defaults to ``3x32x32`` for images and ``64`` for tokens;
- ``vocab_size``: tokens only, default 1000 (the defaults mirror ``bert_small``).

Each has a ceiling (`MAX_INPUT_ELEMENTS`, `MAX_VOCAB`), since a job comes from the network.

Importing a module runs its code, so a job may only name modules the operator listed
in the service's own settings (``model_modules``): `check_model_source` refuses any
other before anything is imported, whatever the job says. What the factory raises,
``SystemExit`` and ``KeyboardInterrupt`` included, becomes a ConfigError naming the
model, so that user code ends a job, never a service.
"""

import importlib
import math
from collections.abc import Callable, Collection
from types import ModuleType
from typing import Literal, TypeVar

from common.errors import ConfigError
from common.zoo._options import Options
from common.zoo._types import IMAGE_SHAPE, ModelSpec

__all__ = [
    "MAX_INPUT_ELEMENTS",
    "MAX_VOCAB",
    "USER_CODE_ERRORS",
    "InputKind",
    "allowed_source",
    "check_custom_options",
    "check_model_source",
    "import_user_module",
    "input_options",
    "is_custom_name",
    "load_factory",
    "model_factory",
]

MAX_INPUT_ELEMENTS = 1 << 24
"""Most elements of one input sample (a 4096x4096 image is 16 M); each dimension too."""

MAX_VOCAB = 1 << 20
"""Most distinct token ids: 4x the largest tokenizers in use."""

_MAX_DIMS = 8

_INPUT_OPTIONS = frozenset({"input_kind", "input_shape", "vocab_size"})

_F = TypeVar("_F", bound=Callable[[], object])

InputKind = Literal["image", "tokens"]

_FACTORIES: dict[int, Callable[[], object]] = {}
"""Every callable declared with `model_factory`, by identity (and kept alive, so an id
is never reused by another object)."""


def model_factory(factory: _F) -> _F:
    """Declare ``factory`` a model factory that ``"module:name"`` may name in a job.

    An allow-listed module holds more than factories (helpers, caches, things that
    delete files); a job may only call what the module's author marked for it::

        from common.zoo import model_factory

        @model_factory
        def my_net():
            return nn.Sequential(...)
    """
    if not callable(factory):
        raise TypeError(f"model_factory needs a callable, got {type(factory).__name__}")
    _FACTORIES[id(factory)] = factory
    return factory


def _is_factory(value: object) -> bool:
    return _FACTORIES.get(id(value)) is value


USER_CODE_ERRORS = (Exception, SystemExit, KeyboardInterrupt)
"""What user code may raise that must not escape as such: ``sys.exit()`` in a factory
(or in the module it imports) would otherwise stop the service that checks a job."""


def is_custom_name(name: str) -> bool:
    """Tell whether a model name points at user code rather than the zoo."""
    return ":" in name


def check_model_source(name: str, allowed_modules: Collection[str]) -> None:
    """Refuse a ``module:factory`` name whose module the operator did not allow-list.

    Called before anything is imported: the job names the model, but only the
    service's own ``model_modules`` setting decides which modules may run. Zoo names
    pass; a custom name passes only if its module is listed exactly (a listed package
    does not admit its submodules, and ``os`` or ``sys`` are never implied).

    Raises:
        ConfigError: Names the field ``model.name``, the module and the setting.

    """
    if is_custom_name(name):
        allowed_source("model.name", name, allowed_modules)


def allowed_source(field: str, name: str, allowed_modules: Collection[str]) -> tuple[str, str]:
    """The module and attribute of `name` ("package.module:attr"), once the allow-list has it.

    Nothing is imported: the job's `field` names the code, the service's own
    ``model_modules`` setting decides whether it may run (custom models and
    custom datasets alike).

    Raises:
        ConfigError: Names `field`, the module and the setting.

    """
    module_name, _, attr = name.partition(":")
    if not module_name or not attr or ":" in attr:
        raise ConfigError(f"{field} {name!r}: name must look like 'package.module:factory'")
    if module_name not in allowed_modules:
        listed = ", ".join(sorted(allowed_modules)) or "none"
        raise ConfigError(
            f"{field} {name!r}: module {module_name!r} is not in this service's "
            f"model_modules setting (ASTEROID_MODEL_MODULES / --model-modules; allowed: "
            f"{listed}); a job cannot allow a module itself"
        )
    return module_name, attr


def import_user_module(what: str, module_name: str) -> ModuleType:
    """Import allow-listed `module_name`; whatever its code raises is a ConfigError on `what`."""
    try:
        return importlib.import_module(module_name)
    except USER_CODE_ERRORS as exc:  # any import-time failure is a bad spec, not a crash
        raise ConfigError(f"{what}: cannot import module {module_name!r}: {exc!r}") from exc


def load_factory(spec: ModelSpec) -> Callable[[], object]:
    """The declared factory ``spec.name`` names, from its allow-listed module; not called."""
    module_name, _, attr = spec.name.partition(":")
    if not module_name or not attr or ":" in attr:
        raise ConfigError(
            f"custom model {spec.name!r}: name must look like 'package.module:factory'"
        )
    module = import_user_module(f"custom model {spec.name!r}", module_name)
    # the module's own namespace only: no module __getattr__, no descriptor runs
    factory = vars(module).get(attr)
    if factory is None or not callable(factory):
        raise ConfigError(
            f"custom model {spec.name!r}: module {module_name!r} has no callable {attr!r}"
        )
    if not _is_factory(factory):
        raise ConfigError(
            f"custom model {spec.name!r}: {attr!r} in module {module_name!r} is not declared "
            "a model factory (decorate it with common.zoo.model_factory); nothing was called"
        )
    return factory  # type: ignore[no-any-return]


def check_custom_options(spec: ModelSpec) -> None:
    """Check a custom model's input options against their types and ceilings; no import.

    Raises:
        ConfigError: Names the option, what it must be and what it is.

    """
    input_options(spec)


def input_options(spec: ModelSpec) -> tuple[InputKind, tuple[int, ...], int | None]:
    """``(kind, shape, vocab_size)`` of a custom model's input, from its options.

    Plain values, so that a job is checked without torch; the builder turns them into
    an `InputSpec` (`common.zoo._custom_build`).
    """
    opts = Options(spec, _INPUT_OPTIONS)
    kind = opts.get_str("input_kind", "image")
    if kind not in ("image", "tokens"):
        raise opts.error("input_kind", "'image' or 'tokens'", kind)
    if kind == "image":
        if opts.has("vocab_size"):
            raise opts.error("vocab_size", "absent for image input", opts.get_raw("vocab_size", 0))
        shape = _parse_shape(opts) if opts.has("input_shape") else IMAGE_SHAPE
        return "image", shape, None
    shape = _parse_shape(opts) if opts.has("input_shape") else (64,)
    vocab_size = opts.get_int("vocab_size", 1000, maximum=MAX_VOCAB)
    return "tokens", shape, vocab_size


def _parse_shape(opts: Options) -> tuple[int, ...]:
    raw = opts.get_raw("input_shape", "")
    expected = "a shape like '3x32x32' or a positive int"
    if isinstance(raw, int) and not isinstance(raw, bool):
        dims = [str(raw)]
    elif isinstance(raw, str):
        dims = raw.lower().split("x")
    else:
        raise opts.error("input_shape", expected, raw)
    # digits only and a bounded length before int(): no huge number is ever parsed
    if len(dims) > _MAX_DIMS or not all(d.strip().isdigit() and len(d) <= 9 for d in dims):
        raise opts.error("input_shape", expected, raw)
    shape = tuple(int(d) for d in dims)
    if min(shape) < 1 or math.prod(shape) > MAX_INPUT_ELEMENTS:
        raise opts.error(
            "input_shape",
            f"{expected}, at most {_MAX_DIMS} dimensions and {MAX_INPUT_ELEMENTS} elements",
            raw,
        )
    return shape
