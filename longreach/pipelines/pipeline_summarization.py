"""Summarization pipeline for long-input models (LOCOST, VCC-T5, Dodo) and, as a fallback, any generative model.

transformers v5 removed ``pipeline("summarization")``. This ``Pipeline`` brings it back for our checkpoints:

* ``import longreach`` registers it under the task name ``"long-summarization"``;
* every checkpoint saved by longreach lists it as ``config.custom_pipelines["summarization"]`` and carries a flat copy
  of this file, so ``pipeline("summarization", model=path_or_repo, trust_remote_code=True)`` works where longreach is
  not installed.

This file is copied as-is into checkpoints: it imports only the standard library, torch and transformers.

How a document becomes a summary:

1. ``model.prepare_summarization_inputs(tokenizer, documents, max_input_length)`` (the model's own protocol) builds the
   ``generate()`` keyword arguments: ``input_ids`` and ``attention_mask``, plus model-specific tensors (VCC-T5 marks
   its task prefix as VIP tokens, Dodo wraps the document in the paper's prompt and compresses it into nuggets). It
   also reports, per document, how many tokens it had to drop to respect ``max_input_length``. Models without that
   method get plain tokenization (with ``config.prefix`` if set).
2. ``model.generate(**inputs, **generate_kwargs)``; decoder-only models return the prompt too, which is stripped.
3. The new tokens are decoded into ``{"summary_text": ...}``.

With ``question=...``, the model's ``prepare_question_inputs(tokenizer, question, documents, max_input_length)``
builds the inputs instead (VCC-T5 marks the question as VIP tokens, Dodo asks it in the paper's question-answering
prompt), and ``summary_text`` holds the answer. Models without that method (LOCOST, trained to summarize only) refuse
a question.

Nothing is ever truncated silently: whenever tokens are dropped, a ``UserWarning`` says how many.
"""

from __future__ import annotations

import inspect
import numbers
import sys
import warnings

import torch
from transformers import Pipeline


def _warn_every_time(message: str) -> None:
    """``warnings.warn(message, UserWarning, stacklevel=2)`` for the caller of our caller, shown at every call and
    remembered nowhere. ``warnings.warn`` keeps each text it showed in the calling module's ``__warningregistry__``;
    a text naming each document's length added one entry per truncated document, for the life of a server. Filters
    (``ignore``, ``error``) and ``catch_warnings`` apply as to ``warnings.warn``."""
    frame = sys._getframe(2)
    warnings.warn_explicit(message, UserWarning, frame.f_code.co_filename, frame.f_lineno,
                           module=frame.f_globals.get("__name__"), registry=None, module_globals=frame.f_globals)


class LongSummarizationPipeline(Pipeline):
    """Summarize (long) documents with ``generate()``.

    Example:

    ```python
    >>> from transformers import pipeline
    >>> summarizer = pipeline("summarization", model="path/or/repo", trust_remote_code=True)
    >>> summarizer(long_document, max_new_tokens=128, num_beams=4)
    [{'summary_text': '...'}]
    ```

    Call parameters (also accepted by the constructor, as defaults for every call):

    * ``max_input_length`` (`int`, *optional*): the most tokens the model may read of each input (for VCC-T5 with a
      question, the question's tokens count too). Longer documents lose their end, with a warning giving the number
      of dropped tokens. By default the model decides (LOCOST reads any length).
    * ``question`` (`str` or `list[str]`, *optional*): ask this question of each document instead of summarizing
      it (one string for every document, or a list, or a 🤗 datasets column, of one question per document in a list
      of documents); ``summary_text`` is then the answer. For models with a question format (VCC-T5: the question as
      VIP tokens, warning when it is longer than the model's VIP slots; Dodo: the paper's question-answering
      prompt). A question given to the constructor is asked in every call (a call may replace it, not remove it).
    * ``clean_up_tokenization_spaces`` (`bool`, defaults to `False`), ``return_text`` (`bool`, defaults to `True`),
      ``return_tensors`` (`bool`, defaults to `False`): the output holds ``summary_text`` and/or the token ids as
      ``summary_token_ids``.
    * ``generate_kwargs`` (`dict`) and any other keyword (``max_new_tokens``, ``num_beams``, ``do_sample``,
      ``length_penalty``, ``no_repeat_ngram_size``, ``num_return_sequences``, ``streamer``, ...): passed to
      ``model.generate``. The model's ``generation_config`` supplies everything not given. ``stop_sequence`` (`str`
      or `list[str]`) ends a summary where that text is generated (``stop_strings``, with the pipeline's tokenizer,
      as transformers' text-generation pipeline does); ``return_dict_in_generate=True`` is accepted (the sequences
      are read from it). For decoder-only models
      (Dodo), ``max_length`` and ``min_length`` count the summary's tokens: they are passed as ``max_new_tokens`` /
      ``min_new_tokens``, since the prompt the pipeline builds around a document is not the user's. For
      encoder-decoders they count the decoder start token too, as in transformers, and take precedence over the
      checkpoint's own ``max_new_tokens`` / ``min_new_tokens``.

    A single document gives a list of ``num_return_sequences`` records (one by default); a list of documents gives one
    record per document (a list of records per document when ``num_return_sequences > 1``).
    """

    _load_tokenizer = True
    _load_processor = False
    _load_image_processor = False
    _load_feature_extractor = False
    _load_video_processor = False

    def _sanitize_parameters(
        self,
        max_input_length=None,
        question=None,
        clean_up_tokenization_spaces=None,
        return_text=None,
        return_tensors=None,
        stop_sequence=None,
        generate_kwargs=None,
        **more_generate_kwargs,
    ):
        preprocess_params, postprocess_params = {}, {}
        if stop_sequence is not None:  # transformers' text-generation pipeline: `stop_strings`, with our tokenizer
            sequences = [stop_sequence] if isinstance(stop_sequence, str) else stop_sequence
            if not isinstance(sequences, (list, tuple)) or not sequences or not all(
                    isinstance(text, str) and text for text in sequences):
                raise ValueError(f"`stop_sequence` must be a non-empty string or list of them, got {stop_sequence!r}.")
            if "stop_strings" in more_generate_kwargs or "stop_strings" in (generate_kwargs or {}):
                raise ValueError("Pass `stop_sequence` or `stop_strings`, not both.")
            more_generate_kwargs["stop_strings"] = list(sequences)
        if max_input_length is not None:
            if not isinstance(max_input_length, int) or isinstance(max_input_length, bool) or max_input_length < 1:
                raise ValueError(f"`max_input_length` must be a positive integer, got {max_input_length!r}.")
            preprocess_params["max_input_length"] = max_input_length
        if question is not None:  # a list (one question per document) was taken apart by __call__
            if not isinstance(question, str) or not question.strip():
                raise ValueError(f"`question` must be non-empty text (or, in a call, a list of one question per "
                                 f"document), got {question!r}.")
            self._check_takes_questions()
            preprocess_params["question"] = question

        forward_params = {}
        if generate_kwargs is not None or more_generate_kwargs:
            merged = dict(generate_kwargs or {})
            overlap = set(merged) & set(more_generate_kwargs)
            if overlap:
                raise ValueError(
                    f"{sorted(overlap)} given both as keyword arguments and inside `generate_kwargs`; give each once."
                )
            merged.update(more_generate_kwargs)
            if "truncation" in merged:
                raise ValueError(
                    "This pipeline never truncates on its own: pass `max_input_length=N` to keep at most N document "
                    f"tokens (a warning reports what is dropped); got `truncation={merged['truncation']!r}`."
                )
            if merged.get("stop_strings") is not None and merged.get("tokenizer") is None:
                merged["tokenizer"] = self.tokenizer  # generate() finds stop strings in text through a tokenizer
            forward_params = merged  # one key per option, so that call options update constructor defaults
            if "eos_token_id" in merged:  # where `summary_token_ids` end
                postprocess_params["eos_token_id"] = merged["eos_token_id"]
            elif getattr(merged.get("generation_config"), "eos_token_id", None) is not None:
                postprocess_params["eos_token_id"] = merged["generation_config"].eos_token_id

        if clean_up_tokenization_spaces is not None:
            postprocess_params["clean_up_tokenization_spaces"] = clean_up_tokenization_spaces
        if return_text is not None:
            postprocess_params["return_text"] = return_text
        if return_tensors is not None:
            postprocess_params["return_tensors"] = return_tensors
        # with the constructor's defaults (`Pipeline.__call__` merges them in later; none yet while constructing)
        defaults = getattr(self, "_postprocess_params", {})
        text = return_text if return_text is not None else defaults.get("return_text", True)
        tensors = return_tensors if return_tensors is not None else defaults.get("return_tensors", False)
        if (return_text is not None or return_tensors is not None) and not text and not tensors:
            raise ValueError("`return_text=False` asks for no text, and `return_tensors` is not set (here or when the "
                             "pipeline was made): the output would be empty. Pass `return_tensors=True` for the token "
                             "ids.")
        return preprocess_params, forward_params, postprocess_params

    def __call__(self, documents, *args, **kwargs):
        """Summarize one document (`str`), a list of them (``batch_size=N`` batches them), or a dataset / generator
        of them (results are then yielded as they come)."""
        text_types = (str, bytes, bytearray, dict, list, tuple, torch.utils.data.Dataset)  # (bytes: not a list of ints)
        if not isinstance(documents, text_types) and hasattr(documents, "__len__") and hasattr(documents, "__iter__"):
            documents = list(documents)  # a column of a `datasets.Dataset`, an array of strings, ...
        if isinstance(documents, (list, tuple)):
            if not documents or not all(isinstance(d, str) for d in documents):
                raise ValueError(
                    f"`documents` must be a string or a non-empty list of strings, got a {type(documents).__name__} of "
                    f"{len(documents)} items of types {sorted({type(d).__name__ for d in documents})}."
                )
            documents = list(documents)
            # before any generation: an empty document found in `preprocess` would end the call after the batches
            # before it were summarized, their summaries lost, without saying which document it was
            blank = next((row for row, text in enumerate(documents) if not text.strip()), None)
            if blank is not None:
                raise ValueError(f"`documents[{blank}]` is {documents[blank][:40]!r}: cannot summarize an empty "
                                 "document (only whitespace); leave it out of the list.")
        elif not isinstance(documents, str) and (
            isinstance(documents, (dict, bytes, bytearray))
            or not (hasattr(documents, "__iter__") or hasattr(documents, "__getitem__"))
        ):
            binary = isinstance(documents, (bytes, bytearray))
            hint = " (decode it to text first: `documents.decode()`)" if binary else ""
            raise ValueError(
                f"`documents` must be a string or a non-empty list of strings, got {type(documents).__name__}{hint}."
            )
        given = documents
        question = kwargs.get("question")
        if not isinstance(question, (str, dict, list, tuple)) and hasattr(question, "__len__") \
                and hasattr(question, "__iter__"):
            question = list(question)  # a column of a `datasets.Dataset`, an array of strings, ...
        if isinstance(question, (list, tuple)):  # one question per document: each travels with its document
            if not isinstance(documents, list) or len(question) != len(documents):
                described = (f"{len(documents)} documents" if isinstance(documents, list) else "a single document"
                             if isinstance(documents, str) else f"a {type(documents).__name__} of documents")
                raise ValueError(f"`question` is a list of {len(question)} questions for {described}: give one "
                                 "question per document in a list of documents, or one string for all.")
            for row, text in enumerate(question):
                if not isinstance(text, str) or not text.strip():
                    raise ValueError(f"`question` must be non-empty text, got {text!r} for document {row}.")
            self._check_takes_questions()
            kwargs = {key: value for key, value in kwargs.items() if key != "question"}
            documents = [{"document": document, "question": text} for document, text in zip(documents, question)]
        results = super().__call__(documents, *args, **kwargs)
        if isinstance(given, list) and all(len(records) == 1 for records in results):
            return [records[0] for records in results]
        return results

    def get_iterator(self, inputs, num_workers, batch_size, preprocess_params, forward_params, postprocess_params):
        """transformers' iterator, except that batches need no pad token: ``preprocess`` yields text, which the
        model's own input preparation pads (Dodo's Llama-2 tokenizer has none, and ``batch_size > 1`` was refused)."""
        if batch_size == 1 or self.tokenizer is None or self.tokenizer.pad_token_id is not None:
            return super().get_iterator(inputs, num_workers, batch_size, preprocess_params, forward_params,
                                        postprocess_params)
        from torch.utils.data import DataLoader
        from transformers.pipelines.pt_utils import PipelineDataset, PipelineIterator

        if hasattr(inputs, "__len__"):
            dataset = PipelineDataset(inputs, self.preprocess, preprocess_params)
        else:
            dataset, num_workers = PipelineIterator(inputs, self.preprocess, preprocess_params), 1

        def collate(items):  # one list per key: documents, questions and lengths, as transformers' collation gives
            return {key: [item[key] for item in items] for key in items[0]}

        loader = DataLoader(dataset, num_workers=num_workers, batch_size=batch_size, collate_fn=collate)
        model_iterator = PipelineIterator(loader, self.forward, forward_params, loader_batch_size=batch_size)
        return PipelineIterator(model_iterator, self.postprocess, postprocess_params)

    # Tokenization happens in `_forward`, on whole batches, because the model's own `prepare_summarization_inputs`
    # decides how documents are laid out together (padding side, prompts, extra masks). `preprocess` only validates.
    def preprocess(self, document, max_input_length=None, question=None):
        if isinstance(document, dict) and set(document) == {"document", "question"}:  # made by __call__
            document, question = document["document"], document["question"]
        if not isinstance(document, str):
            raise ValueError(f"Each document must be a string, got {type(document).__name__}.")
        if not document.strip():
            raise ValueError(f"Cannot summarize an empty document (only whitespace), got {document[:40]!r}.")
        return {"document": document, "max_input_length": max_input_length, "question": question}

    def _forward(self, model_inputs, **generate_kwargs):
        documents = model_inputs["document"]
        documents = [documents] if isinstance(documents, str) else list(documents)
        max_input_length = model_inputs["max_input_length"]
        if isinstance(max_input_length, list):
            max_input_length = max_input_length[0]
        questions = model_inputs.get("question")
        if not isinstance(questions, list):
            questions = [questions] * len(documents)
        if all(question is None for question in questions):
            inputs, dropped = self._prepare_inputs(documents, max_input_length)
        else:
            inputs, dropped = self._prepare_inputs(documents, max_input_length, questions)
        for document, count in zip(documents, dropped):
            if count > 0:
                limit = max_input_length if max_input_length is not None else "the model limit"
                _warn_every_time(f"The document ({len(document)} characters) is longer than the model may read: its "
                                 f"last {count} tokens were dropped (max_input_length={limit}).")

        summarizing = all(question is None for question in questions)
        output_ids = self.model.generate(**inputs, **self._generate_options(generate_kwargs, summarizing))
        if not isinstance(output_ids, torch.Tensor):  # `return_dict_in_generate=True`: a GenerateOutput
            output_ids = output_ids.sequences
        if not self.model.config.is_encoder_decoder:
            output_ids = output_ids[:, inputs["input_ids"].shape[1] :]  # decoder-only: drop the prompt
        # generate() returns num_return_sequences rows per document, wherever that number was set (a call option, a
        # `generation_config` passed in, the model's own): [batch, num_return_sequences, length], whose first dimension
        # the base class splits back into documents.
        if output_ids.shape[0] % len(documents):
            raise ValueError(f"generate() returned {output_ids.shape[0]} sequences for {len(documents)} documents.")
        return {"output_ids": output_ids.reshape(len(documents), output_ids.shape[0] // len(documents), -1)}

    def _prepare_inputs(self, documents: list[str], max_input_length: int | None, questions: list[str] | None = None):
        """``generate()`` inputs for ``documents`` and the tokens dropped from each: summaries, or, with
        ``questions`` (one per document), answers."""
        if questions is not None:
            self._check_takes_questions()
            inputs, dropped = self.model.prepare_question_inputs(self.tokenizer, questions, documents,
                                                                 max_input_length=max_input_length)
        elif (prepare := getattr(self.model, "prepare_summarization_inputs", None)) is not None:
            inputs, dropped = prepare(self.tokenizer, documents, max_input_length=max_input_length)
        else:
            inputs, dropped = self._plain_inputs(documents, max_input_length)
        if len(dropped) != len(documents):
            raise ValueError(
                f"The model's input preparation reported dropped tokens for {len(dropped)} documents, expected "
                f"{len(documents)}."
            )
        device = self.model.device
        return {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in inputs.items()}, dropped

    def _generate_options(self, generate_kwargs: dict, summarizing: bool = True) -> dict:
        """The ``generate()`` keyword arguments for the caller's ``generate_kwargs``: when ``summarizing`` (no
        question), a plain model's ``task_specific_params["summarization"]`` under them, and ``max_length`` /
        ``min_length`` counted as the class docstring says. The corpus command (``longreach.corpus``) uses it too."""
        # `max_length=None` / `min_length=None` set nothing, as in generate(): the checkpoint's lengths apply
        generate_kwargs = {key: value for key, value in generate_kwargs.items()
                           if not (key in ("max_length", "min_length") and value is None)}
        if summarizing and self._summarization_task_parameters() and "generation_config" not in generate_kwargs:
            # a plain model (e.g. a T5 checkpoint) with transformers v4's `task_specific_params["summarization"]`:
            # its generation settings, under the caller's, key by key as v4's summarization pipeline applied them
            defaults = {key: value for key, value in self._summarization_task_parameters().items() if key != "prefix"}
            generate_kwargs = {**self._without_replaced_lengths(defaults, generate_kwargs), **generate_kwargs}
        for total, new_tokens in (("max_length", "max_new_tokens"), ("min_length", "min_new_tokens")):
            if total in generate_kwargs and new_tokens not in generate_kwargs:
                generate_kwargs = dict(generate_kwargs)
                if self.model.config.is_encoder_decoder:
                    # the caller's length, not the checkpoint's `max_new_tokens` / `min_new_tokens` (converted
                    # checkpoints set one), which generate() would otherwise prefer to it
                    generate_kwargs[new_tokens] = None
                else:
                    # the prompt is ours, not the user's: a summary's max_length / min_length count the summary alone
                    value, least = generate_kwargs.pop(total), 1 if total == "max_length" else 0
                    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < least:
                        # checked here: generate()'s error would name `max_new_tokens`, which the caller did not give
                        raise ValueError(f"`{total}` (the summary's tokens) must be an integer >= {least}, got "
                                         f"{value!r}.")
                    generate_kwargs[new_tokens] = value
        return generate_kwargs

    def _without_replaced_lengths(self, defaults: dict, generate_kwargs: dict) -> dict:
        """``defaults`` (a checkpoint's ``task_specific_params``) less the bounds on the summary's length that the
        caller's ``generate_kwargs`` replace: the checkpoint's maximum when the caller gives one, or a smaller one than
        the caller's minimum (and the same for minimums). A caller's ``min_length=5`` keeps the checkpoint's
        ``max_length=200``; a caller's ``max_new_tokens=2`` drops the checkpoint's ``min_length=30``, which would clash
        with it."""
        # in summary tokens: an encoder-decoder's max_length / min_length count the decoder start token too
        start = 1 if self.model.config.is_encoder_decoder else 0

        def bound(options, side):
            values = [options[f"{side}_length"] - start] if options.get(f"{side}_length") is not None else []
            values += [options[f"{side}_new_tokens"]] if options.get(f"{side}_new_tokens") is not None else []
            return None if not values else min(values) if side == "max" else max(values)

        caller_max, caller_min = bound(generate_kwargs, "max"), bound(generate_kwargs, "min")
        own_max, own_min = bound(defaults, "max"), bound(defaults, "min")
        drop_max = any(f"max_{key}" in generate_kwargs for key in ("length", "new_tokens")) or (
            own_max is not None and caller_min is not None and own_max < caller_min)
        drop_min = any(f"min_{key}" in generate_kwargs for key in ("length", "new_tokens")) or (
            own_min is not None and caller_max is not None and own_min > caller_max)
        dropped = {f"{side}_{key}" for side, drop in (("max", drop_max), ("min", drop_min)) if drop
                   for key in ("length", "new_tokens")}
        return {key: value for key, value in defaults.items() if key not in dropped}

    def _summarization_task_parameters(self) -> dict:
        """``config.task_specific_params["summarization"]`` of a plain model (a v4-era T5 checkpoint: its prefix,
        beams and lengths), or ``{}``; longreach models prepare their inputs themselves."""
        if getattr(self.model, "prepare_summarization_inputs", None) is not None:
            return {}
        parameters = getattr(self.model.config, "task_specific_params", None)
        parameters = parameters.get("summarization") if isinstance(parameters, dict) else None
        return dict(parameters) if isinstance(parameters, dict) else {}

    def _check_takes_questions(self):
        if getattr(self.model, "prepare_question_inputs", None) is None:
            raise ValueError(
                f"`question`: {type(self.model).__name__} has no question format (no `prepare_question_inputs`); it "
                "can only summarize. VCC-T5 and Dodo models answer questions; leave `question` out to summarize."
            )

    def _plain_inputs(self, documents: list[str], max_input_length: int | None):
        """Fallback for models without ``prepare_summarization_inputs``: ``config.prefix`` + document, tokenized,
        cut (from the end, keeping a final EOS) to ``max_input_length`` or the model's position limit, padded on the
        right for encoder-decoders and on the left for decoder-only models. (The models' own helpers in
        ``input_checks`` are not imported: this file also serves models that ship without them.)"""
        config = self.model.config
        prefix = self._summarization_task_parameters().get("prefix") or getattr(config, "prefix", None) or ""
        if max_input_length is None:
            for name in ("max_position_embeddings", "n_positions", "max_source_positions"):
                limit = getattr(config, name, None)
                if isinstance(limit, int) and limit > 0:
                    max_input_length = limit
                    break
        encoded = self.tokenizer([prefix + document for document in documents])["input_ids"]
        eos = self.tokenizer.eos_token_id
        rows, dropped = [], []
        for ids in encoded:
            ids = list(ids)
            if max_input_length is not None and len(ids) > max_input_length:
                dropped.append(len(ids) - max_input_length)
                ids = ids[: max_input_length - 1] + ids[-1:] if ids[-1] == eos else ids[:max_input_length]
            else:
                dropped.append(0)
            rows.append(ids)
        pad = self.tokenizer.pad_token_id
        if pad is None:
            pad = config.pad_token_id if getattr(config, "pad_token_id", None) is not None else 0
        length = max(len(ids) for ids in rows)
        input_ids = torch.full((len(rows), length), pad, dtype=torch.long)
        attention_mask = torch.zeros((len(rows), length), dtype=torch.long)
        pad_left = not config.is_encoder_decoder
        for row, ids in enumerate(rows):
            span = slice(length - len(ids), length) if pad_left else slice(0, len(ids))
            input_ids[row, span] = torch.tensor(ids, dtype=torch.long)
            attention_mask[row, span] = 1
        return {"input_ids": input_ids, "attention_mask": attention_mask}, dropped

    def postprocess(self, model_outputs, clean_up_tokenization_spaces=False, return_text=True, return_tensors=False,
                    eos_token_id=None):
        records = []
        eos = self.model.generation_config.eos_token_id if eos_token_id is None else eos_token_id
        eos = set(eos if isinstance(eos, (list, tuple)) else [] if eos is None else [eos])
        # an encoder-decoder's output starts with the decoder start token, which may be the EOS id; a decoder-only
        # model's output here is the summary alone (the prompt was dropped), whose first token may end it
        first = 1 if self.model.config.is_encoder_decoder else 0
        for ids in model_outputs["output_ids"][0]:
            record = {}
            # Up to the first end of sequence: in a batch, finished rows are filled up to the longest one (with the pad
            # id, or the end token itself), which a caller's end token that is not special would leave in the text
            ends = [i for i, token in enumerate(ids.tolist()) if token in eos and i >= first]
            ids = ids[: ends[0] + 1] if ends else ids
            if return_tensors:
                record["summary_token_ids"] = ids
            if return_text:
                record["summary_text"] = self.tokenizer.decode(
                    ids, skip_special_tokens=True, clean_up_tokenization_spaces=clean_up_tokenization_spaces
                )
            records.append(record)
        return records

    def save_pretrained(self, save_directory, **kwargs):
        """transformers' ``Pipeline.save_pretrained``, with the folder's ``config.custom_pipelines`` naming this
        pipeline under ``"summarization"`` (as longreach models save it), also for a plain model (a T5): the folder then
        answers ``pipeline("summarization", model=folder, trust_remote_code=True)``, and, where longreach is imported,
        ``pipeline("long-summarization", model=folder)``."""
        from transformers import AutoModelForCausalLM, AutoModelForSeq2SeqLM

        auto_class = AutoModelForSeq2SeqLM if self.model.config.is_encoder_decoder else AutoModelForCausalLM
        # read by the base class in place of the registry's entry (registered as "long-summarization")
        self._registered_impl = {"summarization": {"impl": type(self), "pt": (auto_class,), "type": "text"}}
        try:
            return super().save_pretrained(save_directory, **kwargs)
        finally:
            del self._registered_impl

    def push_to_hub(self, repo_id: str, **kwargs):
        """Upload the model, its code, the tokenizer and the model card in one commit.

        longreach models (``save_pretrained`` writes their code; ``push_to_hub`` takes a ``tokenizer``) do it
        themselves; other models go through transformers' generic ``Pipeline.push_to_hub``.
        """
        if "tokenizer" in inspect.signature(self.model.push_to_hub).parameters:
            return self.model.push_to_hub(repo_id, tokenizer=self.tokenizer, **kwargs)
        return super().push_to_hub(repo_id, **kwargs)
