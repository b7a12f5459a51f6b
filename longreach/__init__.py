"""longreach: long-input models (LOCOST, VCC-T5, Dodo) as first-class Hugging Face transformers models.

``import longreach`` registers every model with the Auto classes (``AutoConfig``, ``AutoModel``,
``AutoModelForSeq2SeqLM`` / ``AutoModelForCausalLM``) and the ``long-summarization`` pipeline. Nothing else happens
on import.
"""

from transformers import AutoConfig, AutoModel, AutoModelForCausalLM, AutoModelForSeq2SeqLM
from transformers.pipelines import PIPELINE_REGISTRY

from .configuration.configuration_locost import LocostConfig
from .configuration.configuration_vcc_t5 import VCCT5Config
from .configuration.configuration_dodo import DodoLlamaConfig
from .modeling.modeling_locost import LocostForConditionalGeneration, LocostModel
from .modeling.modeling_dodo import DodoCache, DodoDataCollator, DodoLlamaForCausalLM, DodoNuggets
from .modeling.modeling_vcc_t5 import (
    VCCT5DataCollator,
    VCCT5ForConditionalGeneration,
    VCCT5Model,
    prepare_vip_inputs,
)
from .pipelines.pipeline_summarization import LongSummarizationPipeline

__version__ = "0.1.0"

# -- LOCOST --
AutoConfig.register(LocostConfig.model_type, LocostConfig, exist_ok=True)
AutoModel.register(LocostConfig, LocostModel, exist_ok=True)
AutoModelForSeq2SeqLM.register(LocostConfig, LocostForConditionalGeneration, exist_ok=True)

# -- VCC-T5 --
AutoConfig.register(VCCT5Config.model_type, VCCT5Config, exist_ok=True)
AutoModel.register(VCCT5Config, VCCT5Model, exist_ok=True)
AutoModelForSeq2SeqLM.register(VCCT5Config, VCCT5ForConditionalGeneration, exist_ok=True)

# -- Dodo --
AutoConfig.register(DodoLlamaConfig.model_type, DodoLlamaConfig, exist_ok=True)
AutoModel.register(DodoLlamaConfig, DodoLlamaForCausalLM, exist_ok=True)
AutoModelForCausalLM.register(DodoLlamaConfig, DodoLlamaForCausalLM, exist_ok=True)

# -- pipelines --
PIPELINE_REGISTRY.register_pipeline(
    "long-summarization",
    pipeline_class=LongSummarizationPipeline,
    pt_model=(AutoModelForSeq2SeqLM, AutoModelForCausalLM),
    type="text",
)

__all__ = ["LocostConfig", "LocostModel", "LocostForConditionalGeneration",
           "VCCT5Config", "VCCT5Model", "VCCT5ForConditionalGeneration", "VCCT5DataCollator", "prepare_vip_inputs",
           "DodoLlamaConfig", "DodoLlamaForCausalLM", "DodoNuggets", "DodoCache", "DodoDataCollator",
           "LongSummarizationPipeline", "__version__"]
