"""Typed, validated run settings: one pydantic model per command, from flags and config files.

A command's settings are a :class:`RunConfig` of a few sections (``data``, ``model``,
``train``...), each a :class:`Section` of typed fields with a default, a one-line description
and their range. Everything is checked when the object is built, in one place: types are strict
(``"false"`` is not a boolean, ``2.5`` is not a number of blocks), ranges and combinations are
validators, and every failure becomes a :class:`~flowattn.errors.ConfigError` that names the key
and the value. pydantic does the checking; this module adds what the command line needs:

* leaf names are unique across a config's sections, so a flag (``--steps``) or a flat key of a
  config file (``"steps": 500``) names one setting; nested files (``train: {steps: 500}``) work
  too, in JSON or YAML;
* :func:`add_arguments` turns the fields into argparse options with their help and default,
  and :func:`from_sources` merges defaults, a file and the flags a user actually gave.

No torch import here: the command line builds its parsers from these classes, and ``--help``
answers without loading torch.

Examples:
    >>> TrainSettings.parse({"steps": 5, "lr": 0.01}).steps
    5
    >>> try:
    ...     TrainSettings.parse({"steps": "five"}, "train")
    ... except ConfigError as err:
    ...     print(err)
    train: steps: Input should be a valid integer (got 'five')
"""

from __future__ import annotations

import argparse
import json
import types
import typing
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, ClassVar, Literal, Union, get_args, get_origin

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from ..errors import ConfigError

__all__ = [
    "Section",
    "RunConfig",
    "Field",
    "read_config_file",
    "add_arguments",
    "from_sources",
    "DEVICE_PATTERN",
]

# cpu, cuda, cuda:N, or auto (cuda when available); resolved by training.device at run time.
DEVICE_PATTERN = r"^(auto|cpu|cuda(:[0-9]+)?)$"


class Section(BaseModel):
    """A group of typed settings: strict types, no unknown keys, no NaN or infinity."""

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True, allow_inf_nan=False,
                              validate_default=True)

    def __init__(self, **values: Any) -> None:
        try:
            super().__init__(**values)
        except ValidationError as err:
            raise ConfigError(_describe(err)) from None

    def to_dict(self) -> dict:
        """The settings as plain JSON-serialisable values."""
        return self.model_dump(mode="json")

    @classmethod
    def parse(cls, values: Mapping[str, Any], source: str = ""):
        """Validate ``values``; a failure is a ConfigError naming the key and the value."""
        try:
            return cls.model_validate(values)
        except ValidationError as err:
            raise ConfigError(_describe(err, f"{source}: " if source else "")) from None


def _describe(error: ValidationError, prefix: str = "") -> str:
    """One line for a pydantic error: the key (dotted), the reason and the offending value.

    A setting that takes a number or a word (``"auto"``) fails once per alternative; the line
    names the setting once and both alternatives.
    """
    errors = error.errors()
    first = errors[0]
    path = _setting_path(first["loc"])
    key = ".".join(str(part) for part in path)
    message = first["msg"]
    same = [e for e in errors[1:] if _setting_path(e["loc"]) == path]
    words = [e["ctx"]["expected"] for e in same if e["type"] == "literal_error"]
    if words and first["type"] != "literal_error":
        message += f" or {words[0]}"
    if first["type"] == "extra_forbidden":
        message = "unknown setting"
    elif first["type"] in ("value_error", "assertion_error"):
        message = message.removeprefix("Value error, ").removeprefix("Assertion failed, ")
    elif first["type"] == "string_pattern_mismatch" and path and path[-1] == "device":
        message = "is not one of cpu, cuda, cuda:N, auto"  # (the pattern, in words)
    line = f"{prefix}{key}: {message}" if key else f"{prefix}{message}"
    shown = "input" in first and not isinstance(first["input"], dict)
    if shown and first["type"] not in ("missing", "model_type", "value_error"):
        line += f" (got {first['input']!r})"
    more = error.error_count() - 1 - len(same)
    return line + (f"; and {more} more problem(s)" if more else "")


def _setting_path(loc: tuple) -> tuple:
    """An error's location without pydantic's tags of union alternatives (``literal['auto']``,
    ``constrained-float``)."""
    return tuple(part for part in loc if not (isinstance(part, str) and (
        part.startswith(("literal[", "constrained-")) or part in ("float", "int", "str"))))


class RunConfig(Section):
    """The settings of one command, in sections. Leaf names are unique across sections.

    ``RESUMABLE`` names the leaves that may differ when a run is resumed (how long it trains,
    where and how often it reports); every other setting is the run's and must not change.
    """

    RESUMABLE: ClassVar[frozenset[str]] = frozenset()
    #: leaves that may name data files: a run stores them by absolute path (see
    #: :meth:`with_absolute_paths`), so that it resumes from any working directory
    PATHS: ClassVar[frozenset[str]] = frozenset()

    @classmethod
    def sections(cls) -> dict[str, type[Section]]:
        return {name: info.annotation for name, info in cls.model_fields.items()}

    @classmethod
    def leaves(cls) -> dict[str, tuple[str, Any]]:
        """``leaf name -> (section name, field info)`` over every section."""
        out: dict[str, tuple[str, Any]] = {}
        for section, kind in cls.sections().items():
            for name, info in kind.model_fields.items():
                if name in out:
                    raise TypeError(f"setting {name!r} appears in two sections of {cls.__name__}")
                out[name] = (section, info)
        return out

    @classmethod
    def nest(cls, values: Mapping[str, Any], source: str = "settings") -> dict:
        """Sort flat keys (``steps``) into their sections; nested ones pass through."""
        sections, leaves = cls.sections(), cls.leaves()
        nested: dict[str, dict] = {}
        def put(section: str, name: str, value: Any) -> None:
            if name in nested.get(section, {}):  # both flat and in its section
                raise ConfigError(f"{source}: {name} is given twice ({name} and "
                                  f"{section}.{name}): keep one")
            nested.setdefault(section, {})[name] = value

        for key, value in values.items():
            if key in sections and (isinstance(value, Mapping) or key not in leaves):
                if not isinstance(value, Mapping):
                    raise ConfigError(f"{source}: {key} must be a mapping of settings, got "
                                      f"{value!r}")
                for name, inner in value.items():
                    put(key, name, inner)
            elif key in leaves:
                put(leaves[key][0], key, value)
            else:
                raise ConfigError(f"{source}: unknown setting {key!r} (see --print-config for "
                                  "every key)")
        return nested

    @classmethod
    def build(cls, values: Mapping[str, Any] | None = None, source: str = ""):
        """Validate ``values`` (flat or nested) into a config; errors name the key and value."""
        return cls.parse(cls.nest(values or {}, source or "settings"), source)

    @classmethod
    def from_stored(cls, values: Mapping[str, Any], source: str = ""):
        """The settings an earlier run stored (its checkpoint or ``config.json``).

        The same as :meth:`build` here; a command whose defaults changed overrides it so that a
        stored config means what it meant when its run trained.
        """
        return cls.build(values, source)

    def training(self) -> TrainSettings:
        """The ``train`` section as the training loop reads it. A command whose training
        defaults depend on its other sections (the language model's automatic ``lr`` and
        ``warmup``) resolves them here."""
        return self.train

    def flat(self) -> dict:
        """``leaf name -> value`` over every section."""
        return {k: v for section in self.to_dict().values() for k, v in section.items()}

    def updated(self, changes: Mapping[str, Any], source: str = ""):
        """A copy with ``changes`` (flat or nested) applied and validated."""
        merged = self.to_dict()
        for section, values in self.nest(changes, source or "settings").items():
            merged[section].update(values)
        return type(self).build(merged, source)

    def with_absolute_paths(self, recorded: Sequence[str] = ()):
        """A copy whose data files (the leaves in ``PATHS``) are named by absolute path.

        A relative path is looked up first among ``recorded`` (the absolute paths in a run's
        data fingerprint, for the settings a run stored), then from the working directory. Bare
        names (built-in data sets) and paths that name no file are left as they are.
        """
        changes = {}
        for key, value in self.flat().items():
            if key not in self.PATHS or not isinstance(value, str) or Path(value).is_absolute():
                continue
            path = Path(value)
            if not (path.suffix or len(path.parts) > 1):
                continue  # a bare name: a built-in data set, not a file
            found = [Path(c) for c in recorded
                     if Path(c).parts[-len(path.parts):] == path.parts and Path(c).is_file()]
            if found:
                changes[key] = str(found[0])
            elif path.is_file():
                changes[key] = str(path.resolve())
        return self.updated(changes) if changes else self

    def changed(self, other: RunConfig) -> dict[str, tuple[Any, Any]]:
        """``leaf -> (mine, theirs)`` for every setting that differs."""
        mine, theirs = self.flat(), other.flat()
        return {k: (mine[k], theirs.get(k)) for k in mine if mine[k] != theirs.get(k)}


def read_config_file(path: str | Path) -> dict:
    """A config file's settings: a JSON or YAML mapping (by suffix: .json, .yaml, .yml)."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as err:
        raise ConfigError(f"cannot read config {path}: {err.strerror or err}") from None
    except UnicodeDecodeError:
        raise ConfigError(f"config {path} is not UTF-8 text") from None
    try:
        if path.suffix.lower() in (".yaml", ".yml"):
            values = _load_yaml(text)
        else:
            values = json.loads(text, object_pairs_hook=_unique_keys)
    except ConfigError as err:
        raise ConfigError(f"config {path}: {err}") from None
    except Exception as err:  # a syntax error of either parser: one line naming the file
        reason = _parse_error(err)
        if path.suffix.lower() not in ("", ".json", ".yaml", ".yml"):  # read as JSON, unknown
            reason += (f" (a config file is JSON, or YAML named .yaml or .yml; {path.suffix} "
                       "is read as JSON)")
        raise ConfigError(f"config {path} is not valid "
                          f"{'YAML' if path.suffix.lower() in ('.yaml', '.yml') else 'JSON'}: "
                          f"{reason}") from None
    if values is None:  # an empty JSON file is a syntax error; an empty YAML one is null
        raise ConfigError(f"config {path} holds no settings (empty or only comments); write "
                          "{} for the defaults")
    if not isinstance(values, dict):
        raise ConfigError(f"config {path} must hold a mapping of settings, got "
                          f"{type(values).__name__}")
    return values


def _parse_error(err: Exception) -> str:
    """One line for a parser's error: its problem and where (1-based line and column) for
    YAML, whose message puts the place on later lines; JSON's first line names the place."""
    problem = getattr(err, "problem", None)
    mark = getattr(err, "problem_mark", None)
    if problem and mark is not None:  # yaml.MarkedYAMLError
        context = getattr(err, "context", None)
        return ((f"{context}: " if context else "")
                + f"{problem} at line {mark.line + 1}, column {mark.column + 1}")
    return str(err).splitlines()[0] if str(err) else type(err).__name__


def _unique_keys(pairs: list[tuple[Any, Any]]) -> dict:
    """A mapping from its (key, value) pairs, refusing a key given twice (both parsers would
    keep the last one silently)."""
    keys = [key for key, _ in pairs]
    twice = sorted({str(key) for key in keys if keys.count(key) > 1})
    if twice:
        raise ConfigError(f"{', '.join(repr(k) for k in twice)} given twice; keep one")
    return dict(pairs)


def _load_yaml(text: str) -> Any:
    """``yaml.safe_load``, refusing a key written twice in one mapping (keys a merge ``<<``
    brings in may still be overridden, as YAML says)."""
    import yaml

    class Loader(yaml.SafeLoader):
        pass

    def mapping(loader, node):
        _unique_keys([(loader.construct_object(key), None) for key, _ in node.value
                      if key.tag != "tag:yaml.org,2002:merge"])
        return loader.construct_mapping(node, deep=True)

    Loader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, mapping)
    return yaml.load(text, Loader=Loader)  # noqa: S506 - a SafeLoader


# ----------------------------------------------------------------------------- command line


def _options(annotation) -> tuple[Any, bool]:
    """``(inner type, optional)`` of ``X`` or ``X | None``."""
    if get_origin(annotation) in (Union, types.UnionType):
        args = [a for a in get_args(annotation) if a is not type(None)]
        optional = len(args) < len(get_args(annotation))
        return (args[0] if len(args) == 1 else annotation), optional
    return annotation, False


def _number_or_words(annotation) -> tuple[type, tuple[str, ...]] | None:
    """``(int or float, words)`` of a setting typed ``number | Literal[words]``, else None."""
    if get_origin(annotation) not in (Union, types.UnionType):
        return None
    kinds, words = [], []
    for arg in get_args(annotation):
        if get_origin(arg) is Literal:
            words.extend(get_args(arg))
        elif get_origin(arg) is typing.Annotated:
            kinds.append(get_args(arg)[0])
        else:
            kinds.append(arg)
    if len(kinds) == 1 and kinds[0] in (int, float) and words:
        return kinds[0], tuple(words)
    return None


def _parse_number_or_words(kind, words: tuple[str, ...], flag: str):
    def convert(text: str):
        if text in words:
            return text
        try:
            return kind(text)
        except ValueError:
            name = {int: "an integer", float: "a number"}[kind]
            raise argparse.ArgumentTypeError(
                f"{flag} expects {name} or {' or '.join(words)}, got {text!r}") from None

    return convert


def _parse(kind, optional: bool, flag: str):
    def convert(text: str):
        if optional and text.lower() in ("none", "auto", "off"):
            return None
        try:
            return kind(text)
        except ValueError:
            name = {int: "an integer", float: "a number"}.get(kind, kind.__name__)
            raise argparse.ArgumentTypeError(
                f"{flag} expects {name}{' or none' if optional else ''}, got {text!r}"
            ) from None

    return convert


def _flags(name: str, info) -> list[str]:
    """A setting's flags: its name with dashes, then any ``aliases`` the field names."""
    extra = info.json_schema_extra or {}
    return ["--" + name.replace("_", "-"), *extra.get("aliases", ())]


def _default_shown(info) -> str:
    """A setting's default as help and documentation show it: where "none" is a value of its
    own (norm "none"), the automatic default None is "unset"."""
    default = info.get_default(call_default_factory=True)
    inner, _ = _options(info.annotation)
    if default is None and get_origin(inner) is Literal and "none" in get_args(inner):
        return "unset"
    return _show(default)


def _show(value) -> str:
    if value is None:
        return "none"
    if isinstance(value, bool):
        return "on" if value else "off"
    return str(value)


def add_arguments(parser: argparse.ArgumentParser, config: type[RunConfig],
                  skip: tuple[str, ...] = ()) -> None:
    """One option per setting of ``config``, grouped by section, with its help and default.

    Options default to "not given" (``argparse.SUPPRESS``), so that :func:`from_sources` can
    tell a flag the user typed from a default (it matters when a run is resumed).
    """
    for section, kind in config.sections().items():
        group = parser.add_argument_group(f"{section} settings")
        for name, info in kind.model_fields.items():
            if name in skip:
                continue
            flags = _flags(name, info)
            flag = flags[0]
            inner, optional = _options(info.annotation)
            help_text = f"{info.description or ''} (default: {_default_shown(info)})".strip()
            help_text = help_text.replace("%", "%%")
            common = dict(dest=name, default=argparse.SUPPRESS, help=help_text)
            number_or_words = _number_or_words(inner)
            if number_or_words is not None:
                kind, words = number_or_words
                metavar = ("N" if kind is int else "X") + "|" + "|".join(words)
                group.add_argument(*flags, type=_parse_number_or_words(kind, words, flag),
                                   metavar=metavar, **common)
            elif inner is bool:
                group.add_argument(*flags, action=argparse.BooleanOptionalAction, **common)
            elif get_origin(inner) is Literal:
                # "none" is a value of its own where the choices name it (e.g. norm "none"),
                # else the way to ask for an optional setting's automatic default
                literal_none = "none" in get_args(inner)
                choices = list(get_args(inner)) + (["none"] if optional and not literal_none
                                                   else [])
                # a choice that holds a comma ("2,inf") is quoted in the list of choices
                metavar = "{" + ",".join(f"'{c}'" if "," in c else c for c in choices) + "}"
                group.add_argument(*flags, choices=choices, metavar=metavar,
                                   type=_literal(optional and not literal_none), **common)
            elif inner in (int, float, str):
                metavar = (info.json_schema_extra or {}).get(
                    "metavar", {int: "N", float: "X", str: "TEXT"}[inner])
                group.add_argument(*flags, type=_parse(inner, optional, flag), metavar=metavar,
                                   **common)
            else:  # pragma: no cover - a field type the command line cannot express
                raise TypeError(f"setting {name} has a type the command line cannot parse")


def _literal(optional: bool):
    def convert(text: str):
        return None if optional and text == "none" else text

    return convert


def given_flags(args: argparse.Namespace, config: type[RunConfig]) -> dict:
    """The settings the user typed on the command line (flat)."""
    return {name: getattr(args, name) for name in config.leaves() if hasattr(args, name)}


def from_sources(config: type[RunConfig], file: str | Path | None = None,
                 flags: Mapping[str, Any] | None = None):
    """Defaults, then a config file, then flags: one validated config.

    The file and the flags are merged before the defaults fill the rest, so that a config's
    validators see which settings were given (a preset fills only the others).
    """
    values = config.nest(read_config_file(file), str(file)) if file else {}
    if not flags:
        return config.build(values, str(file) if file else "")
    merged = {key: dict(value) for key, value in values.items()}
    for section, given in config.nest(dict(flags), "command line").items():
        merged.setdefault(section, {}).update(given)
    try:
        return config.build(merged, "command line")
    except ConfigError:
        if file:  # a file that is wrong on its own: the error names the file
            config.build(values, str(file))
        raise


def print_config(config: RunConfig, form: str = "yaml") -> str:
    """The full config as YAML (nested by section) or JSON: every key, with its value."""
    values = config.to_dict()
    if form == "json":
        return json.dumps(values, indent=2)
    import yaml

    return yaml.safe_dump(values, sort_keys=False)


# ----------------------------------------------------------------------------- training section

SCHEDULES = ("constant", "cosine", "noam")


class TrainSettings(Section):
    """How a model is optimised and how the run reports: shared by every training command.

    Each command starts from its own defaults (:meth:`with_defaults`); the fields, their ranges
    and their meaning are the same everywhere.
    """

    steps: int = Field(1000, ge=1, description="optimiser steps in total")
    batch_size: int = Field(32, ge=1, description="examples per step (over all processes)")
    lr: float = Field(1e-3, gt=0, description="peak learning rate")
    schedule: Literal["constant", "cosine", "noam"] = Field(
        "cosine", description="learning-rate schedule after the warm-up")
    warmup: int = Field(0, ge=0, description="linear warm-up steps")
    min_lr: float = Field(1e-4, ge=0, description="final learning rate of cosine decay; floor "
                          "of noam")
    beta1: float = Field(0.9, ge=0, lt=1, description="Adam beta1")
    beta2: float = Field(0.999, ge=0, lt=1, description="Adam beta2")
    weight_decay: float = Field(0.0, ge=0, description="decoupled weight decay of matrices "
                                "(AdamW)")
    grad_clip: float | None = Field(1.0, gt=0, description="clip the gradient norm at this "
                                    "value; none: no clipping")
    divergence_factor: float | None = Field(
        None, gt=1, description="stop when the smoothed training loss exceeds this multiple of "
        "its best (for non-negative losses); none: stop only on non-finite values")
    eval_every: int = Field(250, ge=1, description="steps between validations")
    ema: float | None = Field(None, gt=0, lt=1, description="decay of an exponential moving "
                              "average of the parameters (e.g. 0.999); validations, best.pt, "
                              "the final report and the run folder's model use the average; "
                              "none: the parameters as trained")
    keep_best: bool = Field(False, description="end with the parameters of the lowest "
                            "validation loss (kept in best.pt), not the last: the final report "
                            "and later evaluations and samples of the run folder use them")
    checkpoint_every: int = Field(250, ge=1, description="steps between checkpoints")
    log_every: int = Field(10, ge=1, description="steps between training-metric records")
    seed: int = Field(0, ge=0, le=2**64 - 1, description="seed of every random number "
                      "generator")
    device: str = Field("cpu", pattern=DEVICE_PATTERN, description="cpu, cuda, cuda:N or "
                        "auto (cuda when available)")
    threads: int | None = Field(None, ge=1, description="intra-op CPU threads; none: torch's "
                                "default (1 avoids OpenMP waits on a busy machine)")
    compile: bool = Field(False, description="train through torch.compile (on CPU it needs a "
                          "C++ compiler); the checkpoint is the same with and without")

    def model_post_init(self, __context) -> None:
        if self.min_lr > self.lr:
            raise ValueError(f"min_lr ({self.min_lr}) must not exceed lr ({self.lr})")
        if self.schedule == "noam" and self.warmup < 1:
            raise ValueError("the noam schedule needs warmup >= 1")

    @classmethod
    def with_defaults(cls, name: str, **defaults: Any) -> type[TrainSettings]:
        """A subclass whose fields keep their type, range and help but start at ``defaults``."""
        from pydantic import create_model

        fields = {}
        for key, value in defaults.items():
            info = cls.model_fields[key]
            copy = info.__class__.merge_field_infos(info)
            copy.default = value
            fields[key] = (info.annotation, copy)
        return create_model(name, __base__=cls, **fields)
