"""What the three configurations share: ``from_pretrained(path, field=value)`` overrides checked with the stored values,
the fields' types checked against their annotations, and dicts of fields checked for unknown keys.

Imported by each configuration file (and copied beside it into every Hub-ready folder).
"""

from __future__ import annotations

import dataclasses
import sys
import types
import typing

from huggingface_hub.dataclasses import type_validator
from transformers import PreTrainedConfig


def pop_field_overrides(config_class: type[PreTrainedConfig], config_dict: dict, kwargs: dict) -> dict:
    """Move the `from_pretrained(..., field=value)` overrides that are fields of `config_class` (or aliases in its
    `attribute_map`) from `kwargs` into a copy of `config_dict`, which is returned.

    transformers' `from_dict` builds the config from the stored values and then sets the overrides on it, so a config
    class's checks (run at construction) never see them. Merged first, they are checked with the stored values. Other
    kwargs stay in `kwargs` for transformers (`dtype`, `num_labels`, ... and the model's own kwargs)."""
    fields = {field.name for field in dataclasses.fields(config_class)} - {"dtype"}  # dtype="auto" is transformers'
    config_dict = dict(config_dict)
    for key in [key for key in kwargs if key in fields or key in config_class.attribute_map]:
        name = config_class.attribute_map.get(key, key)
        for alias, target in config_class.attribute_map.items():  # a stored alias would be set after the field
            if target == name:
                config_dict.pop(alias, None)
        config_dict[name] = kwargs.pop(key)
    return config_dict


_OWN_FIELD_TYPES: dict[type, dict[str, typing.Any]] = {}


def own_field_types(config_class: type[PreTrainedConfig]) -> dict[str, typing.Any]:
    """The annotated types of the fields `config_class` declares itself (not its parents'), resolved once."""
    if config_class not in _OWN_FIELD_TYPES:
        own = {name: annotation for name, annotation in vars(config_class).get("__annotations__", {}).items()
               if name in {field.name for field in dataclasses.fields(config_class)}}
        _OWN_FIELD_TYPES[config_class] = typing.get_type_hints(
            types.SimpleNamespace(__annotations__=own), globalns=vars(sys.modules[config_class.__module__]))
    return _OWN_FIELD_TYPES[config_class]


def check_field_type(config_class: type[PreTrainedConfig], name: str, value: typing.Any) -> None:
    """Check `value` for the field `name` (or its alias in `attribute_map`) if `config_class` declares that field,
    with huggingface_hub's `type_validator` (what transformers' `@strict` configs such as T5Config and LlamaConfig run
    on every assignment), except that a float field also takes an int, as T5Config's `float | int` fields do, and a
    list field a tuple. A `ValueError` names the field, the expected type and the value: a flag stored as the string
    "false" would otherwise switch a feature on, and `True` would pass for the integer 1. Other names pass."""
    name = config_class.attribute_map.get(name, name)
    expected = own_field_types(config_class).get(name)
    if expected is None:
        return
    union = typing.get_origin(expected) in (typing.Union, types.UnionType)
    accepted = typing.get_args(expected) if union else (expected,)
    if type(value) is int and float in accepted:
        return  # 1 for 1.0
    if isinstance(value, tuple) and any(typing.get_origin(option) is list for option in accepted):
        value = list(value)  # ("q_proj", "v_proj") for a list of names (saved as a JSON list all the same)
    try:
        type_validator(name, value, expected)
    except TypeError as error:
        shown = expected.__name__ if isinstance(expected, type) else str(expected)
        raise ValueError(f"`{name}` must be of type {shown}, got {value!r}.") from error


class FieldTypesCheckedOnAssignment:
    """Base of our configs (before transformers' config class): as in transformers' `@strict` configs (T5Config,
    LlamaConfig), a field is type-checked when it is assigned after construction, by `check_field_type` with each of
    our config classes the instance is (a user's subclass declares fields of its own). During construction the
    configs' `validate_*` methods check every field, with messages of their own; at save time transformers runs
    `validate()`, which each config extends with its model's checks."""

    def __setattr__(self, name, value):
        if self.__dict__.get("_post_init_done"):
            for owner in type(self).__mro__:
                if owner is not FieldTypesCheckedOnAssignment and issubclass(owner, FieldTypesCheckedOnAssignment):
                    check_field_type(owner, name, value)
        super().__setattr__(name, value)


def check_field_types(config: PreTrainedConfig, config_class: type[PreTrainedConfig]) -> None:
    """`check_field_type` for every field `config_class` declares itself, with the values `config` holds."""
    for name in own_field_types(config_class):
        check_field_type(config_class, name, getattr(config, name))


def check_config_fields(config_class: type[PreTrainedConfig], fields: dict, option: str) -> None:
    """Every key of ``fields`` (given as ``option``) is a field of ``config_class`` or one of its aliases: a misspelt
    one would otherwise be stored in config.json and change nothing."""
    known = {field.name for field in dataclasses.fields(config_class)} | set(config_class.attribute_map)
    unknown = sorted(set(fields) - known)
    if unknown:
        raise ValueError(f"{option}: {unknown} {'is not a field' if len(unknown) == 1 else 'are not fields'} of "
                         f"{config_class.__name__}.")
