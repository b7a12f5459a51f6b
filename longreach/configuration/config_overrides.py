"""What the three configurations share: ``from_pretrained(path, field=value)`` overrides checked with the stored values.

Imported by each configuration file (and copied beside it into every Hub-ready folder).
"""

from __future__ import annotations

import dataclasses

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
