"""A plain T5 assembled from ``longreach.modeling.t5_blocks``, to prove the blocks equal transformers' T5."""

from __future__ import annotations

import torch
from torch import nn
from transformers import GenerationMixin, PreTrainedModel, T5Config
from transformers import initialization as init

from longreach.modeling.input_checks import take_cache_argument
from longreach.modeling.t5_blocks import T5DecoderStack, T5EncoderStack, T5Seq2SeqLMMixin, init_t5_module


class BlocksT5ForConditionalGeneration(T5Seq2SeqLMMixin, PreTrainedModel, GenerationMixin):
    config_class = T5Config
    base_model_prefix = "transformer"
    _supports_sdpa = True
    _tied_weights_keys = {
        "encoder.embed_tokens.weight": "shared.weight",
        "decoder.embed_tokens.weight": "shared.weight",
        "lm_head.weight": "shared.weight",
    }

    def __init__(self, config: T5Config):
        super().__init__(config)
        self.shared = nn.Embedding(config.vocab_size, config.d_model)
        self.encoder = T5EncoderStack(config, self.shared)
        self.decoder = T5DecoderStack(config, self.shared)
        self.lm_head = nn.Linear(config.d_model, config.vocab_size, bias=False)
        self.post_init()

    @torch.no_grad()
    def _init_weights(self, module):
        init_t5_module(module, self.config, init)

    def forward(self, input_ids=None, attention_mask=None, decoder_input_ids=None, decoder_attention_mask=None,
                encoder_outputs=None, past_key_values=None, labels=None, use_cache=None, output_attentions=None,
                output_hidden_states=None, return_dict=None, **kwargs):
        past_key_values = take_cache_argument(past_key_values, kwargs)
        if encoder_outputs is None:
            encoder_outputs = self.encoder(input_ids=input_ids, attention_mask=attention_mask)
        return self._lm_head_output(
            encoder_outputs, attention_mask, decoder_input_ids, decoder_attention_mask, None, past_key_values, labels,
            use_cache=bool(use_cache if use_cache is not None else self.config.use_cache),
            output_attentions=bool(output_attentions),
            output_hidden_states=bool(output_hidden_states),
        )
