"""longreach: long-input models (LOCOST, VCC-T5, Dodo) as first-class Hugging Face transformers models.

``import longreach`` registers every model with the Auto classes (``AutoConfig``, ``AutoModel``,
``AutoModelForSeq2SeqLM`` / ``AutoModelForCausalLM``), the ``long-summarization`` pipeline, and LOCOST's and VCC-T5's
default target modules in PEFT's tables (so ``LoraConfig(task_type="SEQ_2_SEQ_LM")`` needs no ``target_modules``, as
on T5). Nothing else happens on import.
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


# -- PEFT's default target modules --
def _register_peft_target_modules() -> None:
    """Give LOCOST and VCC-T5 entries in PEFT's tables of default target modules (one per adapter method, keyed by
    ``model_type``), derived from T5's: VCC-T5 has T5's module names, so it takes T5's entries; LOCOST's decoder is
    T5's, and where T5's entry adapts the attention's query and value (LoRA and its kin) LOCOST's also adapts its
    encoder's SSM gate ``q_proj`` and convolved input ``k_proj``, their counterparts in ``y = q ⊙ BiSSMConv(k)``.
    An entry PEFT already has is kept."""
    import peft.utils.constants as peft_tables

    for name, table in vars(peft_tables).items():
        if not (name.startswith("TRANSFORMERS_MODELS_TO_") and isinstance(table, dict)):
            continue
        t5_modules = table.get("t5")
        if not isinstance(t5_modules, list):
            continue
        ssm_modules = ["q_proj", "k_proj"] if {"q", "v"} <= set(t5_modules) else []
        table.setdefault(VCCT5Config.model_type, list(t5_modules))
        table.setdefault(LocostConfig.model_type, list(t5_modules) + ssm_modules)


_register_peft_target_modules()

__all__ = ["LocostConfig", "LocostModel", "LocostForConditionalGeneration",
           "VCCT5Config", "VCCT5Model", "VCCT5ForConditionalGeneration", "VCCT5DataCollator", "prepare_vip_inputs",
           "DodoLlamaConfig", "DodoLlamaForCausalLM", "DodoNuggets", "DodoCache", "DodoDataCollator",
           "LongSummarizationPipeline", "__version__"]
