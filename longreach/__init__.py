"""longreach: long-input models (LOCOST, VCC-T5, Dodo) as first-class Hugging Face transformers models.

``import longreach`` registers every model with the Auto classes (``AutoConfig``, ``AutoModel``,
``AutoModelForSeq2SeqLM`` / ``AutoModelForCausalLM``) and the ``long-summarization`` pipeline. Nothing else happens
on import.
"""

from transformers import AutoConfig, AutoModel, AutoModelForSeq2SeqLM

from .configuration.configuration_locost import LocostConfig
from .modeling.modeling_locost import LocostForConditionalGeneration, LocostModel

__version__ = "0.1.0"

# -- LOCOST --
AutoConfig.register(LocostConfig.model_type, LocostConfig, exist_ok=True)
AutoModel.register(LocostConfig, LocostModel, exist_ok=True)
AutoModelForSeq2SeqLM.register(LocostConfig, LocostForConditionalGeneration, exist_ok=True)

# -- VCC-T5 --

# -- Dodo --

# -- pipelines --

__all__ = ["LocostConfig", "LocostModel", "LocostForConditionalGeneration", "__version__"]
