"""Model input handling shared by the three models: clear ``ValueError`` messages for bad input, and the batching of
tokenized documents that each model's ``prepare_summarization_inputs`` does.

Each message names the argument, what was given and what was expected, so that a user can fix the call without
reading our source. This module is copied into saved checkpoints (remote code); it only imports torch.
"""

from __future__ import annotations

import torch


def describe(tensor: torch.Tensor) -> str:
    return f"a {tensor.dtype} tensor of shape {tuple(tensor.shape)}"


def values_readable(tensor: torch.Tensor) -> bool:
    """Whether a check may read ``tensor``'s values: in eager mode, not on the meta device (shapes only, as when
    tracing a model's operators or shapes without data), and not batched by ``torch.func.vmap`` (a batched tensor's
    values cannot be read back; ``torch.func.grad`` alone allows it)."""
    return not torch.compiler.is_compiling() and tensor.device.type != "meta" and not _batched_by_vmap(tensor)


def _functorch_api(name: str):
    """A function of torch's private functorch API (``torch._C._functorch``), or None where a torch release lacks it:
    then no tensor counts as wrapped and no transform as running (the code paths from before torch.func support)."""
    return getattr(getattr(torch._C, "_functorch", None), name, None)


def in_functorch_transform() -> bool:
    """Whether a ``torch.func`` transform (``grad``, ``vmap``, ``jvp``...) is running."""
    current_level = _functorch_api("maybe_current_level")
    return current_level is not None and current_level() is not None


def functorch_wrapped(tensor: torch.Tensor) -> bool:
    """Whether a ``torch.func`` transform wraps ``tensor`` (its data cannot be read by pointer)."""
    wrapped = _functorch_api("is_functorch_wrapped_tensor")
    return wrapped is not None and wrapped(tensor)


def supports_float64(device: torch.device) -> bool:
    """Whether ``device`` has float64 and complex128 tensors (Apple's ``mps`` has neither: the SSM kernel and Dodo's
    nugget count use float32 ways there)."""
    return device.type != "mps"


def _batched_by_vmap(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` is, or wraps, a tensor batched by ``torch.func.vmap`` (at any level of nested transforms)."""
    is_batched, unwrapped = _functorch_api("is_batchedtensor"), _functorch_api("get_unwrapped")
    for _ in range(64 if is_batched is not None and unwrapped is not None else 0):  # one wrapper per transform
        if not functorch_wrapped(tensor):
            return False
        if is_batched(tensor):
            return True
        tensor = unwrapped(tensor)
    return False


def unwrap_layer(layer: torch.nn.Module, attribute: str) -> torch.nn.Module:
    """``layer``, or the layer it wraps that has ``attribute``: PEFT's ``trainable_token_indices`` and
    ``modules_to_save`` keep the embedding or LM head they wrap as ``original_module`` and forward only its weight."""
    for _ in range(8):
        if hasattr(layer, attribute):
            return layer
        inner = getattr(layer, "original_module", None)
        if inner is None and hasattr(layer, "get_base_layer"):
            inner = layer.get_base_layer()
        if inner is None or inner is layer:
            break
        layer = inner
    return layer


def embedding_shape(embedding: torch.nn.Module) -> tuple[int, int]:
    """``(num_embeddings, embedding_dim)`` of an input embedding, also when PEFT wraps it (see `unwrap_layer`)."""
    embedding = unwrap_layer(embedding, "num_embeddings")
    return embedding.num_embeddings, embedding.embedding_dim


def check_token_ids(name: str, ids: torch.Tensor | None, *, allow_empty: bool = False, vocab_size: int | None = None,
                    ignore_index: int | None = None) -> None:
    """``ids`` must be a 2-D integer tensor ``[batch, length]`` with length > 0, and with ``vocab_size`` every id in
    ``[0, vocab_size)`` (``ignore_index`` excepted: -100 in labels). The range check reads one flag back."""
    if ids is None:
        return
    if not isinstance(ids, torch.Tensor):
        raise ValueError(f"`{name}` must be a torch.LongTensor of shape [batch, length], got {type(ids).__name__}.")
    if ids.dtype.is_floating_point or ids.dtype.is_complex or ids.dtype == torch.bool:
        raise ValueError(
            f"`{name}` must hold integer token ids (torch.long), got {describe(ids)}. "
            "Did you pass embeddings or an attention mask by mistake?"
        )
    # embeddings take int64 or int32 ids, the loss int64 labels only: anything else failed deep inside torch
    accepted = (torch.long,) if ignore_index is not None else (torch.long, torch.int32)
    if ids.dtype not in accepted:
        raise ValueError(f"`{name}` must be a torch.long (int64) tensor{'' if len(accepted) == 1 else ' or int32'}, "
                         f"got {describe(ids)}: pass `{name}.long()`.")
    if ids.dim() != 2:
        raise ValueError(f"`{name}` must have shape [batch, length], got {describe(ids)}.")
    if not allow_empty and (ids.shape[0] == 0 or ids.shape[1] == 0):
        raise ValueError(f"`{name}` must hold at least one sequence of at least one token, got {describe(ids)}.")
    if vocab_size is not None and ids.numel() > 0 and values_readable(ids):  # data-dependent
        values = ids if ignore_index is None else ids.masked_fill(ids == ignore_index, 0)
        if bool(((values < 0) | (values >= vocab_size)).any()):  # one read-back (host sync on an accelerator)
            low, high = (int(value) for value in torch.aminmax(values))
            ignored = f" (besides {ignore_index}, which marks ignored positions)" if ignore_index is not None else ""
            raise ValueError(
                f"`{name}` holds the token id {low if low < 0 else high}, outside this model's vocabulary: ids must be "
                f"in [0, {vocab_size}){ignored}. Was it tokenized with another model's tokenizer?"
            )


def check_mask(name: str, mask: torch.Tensor | None, like_name: str, like: torch.Tensor | None) -> None:
    """``mask`` must be 2-D and have exactly the shape ``[batch, length]`` of ``like``."""
    if mask is None or like is None:
        return
    if not isinstance(mask, torch.Tensor):
        raise ValueError(f"`{name}` must be a tensor of shape {tuple(like.shape[:2])}, got {type(mask).__name__}.")
    if tuple(mask.shape) != tuple(like.shape[:2]):
        raise ValueError(
            f"`{name}` must have the shape [batch, length] = {tuple(like.shape[:2])} of `{like_name}`, "
            f"got {describe(mask)}."
        )


def check_binary_mask(name: str, mask: torch.Tensor | None) -> None:
    """A mask holds 0 (padding) and 1 (a token) only: a 0.5 or a 2 is not a weight, and was read as 0 or 1."""
    if mask is None or not values_readable(mask) or mask.dtype == torch.bool:  # data-dependent
        return
    not_binary = (mask != 0) & (mask != 1)
    if bool(not_binary.any()):  # one read-back
        raise ValueError(f"`{name}` must hold 0 (padding) and 1 (a token) only, got the value "
                         f"{mask[not_binary][0].item()!r}: a mask is not a weight.")


def check_rows_not_empty(name: str, mask: torch.Tensor | None) -> None:
    """An attention mask holds 0 (padding) and 1 (token) only, and every row keeps at least one real token."""
    if mask is None or not values_readable(mask):  # data-dependent
        return
    not_binary = (mask != 0) & (mask != 1)
    empty_rows = mask.sum(dim=-1) == 0
    if bool(not_binary.any() | empty_rows.any()):  # one read-back; the details only for the error
        if bool(not_binary.any()):
            raise ValueError(
                f"`{name}` must hold 0 (padding) and 1 (a token) only, got the value {mask[not_binary][0].item()!r}: "
                "a mask is not a weight."
            )
        empty = empty_rows.nonzero().flatten().tolist()
        raise ValueError(
            f"`{name}` has rows with no real token (rows {empty} are all zeros); every sequence needs at least one "
            "token: drop those rows."
        )


def check_hidden_states(name: str, states, hidden_size: int, rows_name: str | None = None,
                        rows: int | None = None) -> None:
    """``states`` (embeddings, or an encoder's output) must be a floating-point ``[batch, length > 0, hidden_size]``
    tensor, with ``rows`` rows when given."""
    if states is None:
        return
    if not isinstance(states, torch.Tensor) or not states.dtype.is_floating_point or states.dim() != 3 \
            or states.shape[1] == 0 or states.shape[-1] != hidden_size:
        shown = describe(states) if isinstance(states, torch.Tensor) else type(states).__name__
        raise ValueError(f"`{name}` must be a floating-point tensor of shape [batch, length, {hidden_size}] (length "
                         f"> 0; {hidden_size}: this model's hidden size), got {shown}.")
    if rows is not None and states.shape[0] != rows:
        raise ValueError(f"`{name}` has {states.shape[0]} rows but `{rows_name}` has {rows}.")


def cut_to_length(ids: list[int], max_length: int | None, eos_token_id: int | None) -> tuple[list[int], int]:
    """``(ids cut from the end to at most max_length tokens, how many were dropped)``; a final EOS stays the final
    token. ``max_length=None`` keeps everything."""
    if max_length is not None and (isinstance(max_length, bool) or not isinstance(max_length, int) or max_length < 1):
        raise ValueError(f"`max_length` (tokens to keep) must be a positive integer or None, got {max_length!r}.")
    ids = list(ids)
    if max_length is None or len(ids) <= max_length:
        return ids, 0
    dropped = len(ids) - max_length
    if eos_token_id is not None and ids[-1] == eos_token_id:
        return ids[: max_length - 1] + ids[-1:], dropped
    return ids[:max_length], dropped


def summarization_documents(documents: str | list[str], allow_empty: bool = True) -> list[str]:
    """``documents`` of ``prepare_summarization_inputs`` / ``prepare_question_inputs`` as a list of strings: a string
    is one document (not its characters). ``allow_empty=False`` refuses a blank one (a question would be answered
    from itself alone); training data may hold one, which fine-tuning reads through the same preparation."""
    documents = [documents] if isinstance(documents, str) else list(documents)
    if not documents:
        raise ValueError("`documents` must hold at least one document, got an empty list.")
    for row, document in enumerate(documents):
        if not isinstance(document, str):
            raise ValueError(f"Every document must be a string, got {type(document).__name__} {document!r:.40} for "
                             f"document {row}.")
        if not allow_empty and not document.strip():
            raise ValueError(f"Every document must be a non-empty string, got {document!r:.40} for document {row}.")
    return documents


def question_per_document(question, num_documents: int) -> list[str]:
    """``question`` of a ``prepare_question_inputs`` call as one question per document: a string is asked of every
    document; a list gives each document its own. Each must be a non-empty string."""
    questions = [question] * num_documents if isinstance(question, str) else question
    if not isinstance(questions, (list, tuple)) or len(questions) != num_documents:
        given = f"a list of {len(questions)}" if isinstance(questions, (list, tuple)) else type(question).__name__
        raise ValueError(f"`question` must be a string (asked of every document) or a list of one string per document "
                         f"({num_documents}), got {given}.")
    for row, text in enumerate(questions):
        if not isinstance(text, str) or not text.strip():
            raise ValueError(f"`question` must be non-empty text, got {text!r} for document {row}.")
    return list(questions)


def pad_right(rows: list[list[int]], pad_token_id: int,
              pad_to_multiple_of: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(input_ids, attention_mask)`` of shape ``[len(rows), longest row]`` (rounded up to a multiple of
    ``pad_to_multiple_of`` if given): the rows (token lists or 1-D tensors) padded on the right."""
    width = max(len(ids) for ids in rows)
    if pad_to_multiple_of:
        width += -width % pad_to_multiple_of
    input_ids = torch.full((len(rows), width), pad_token_id, dtype=torch.long)
    attention_mask = torch.zeros((len(rows), width), dtype=torch.long)
    for row, ids in enumerate(rows):
        input_ids[row, : len(ids)] = torch.as_tensor(ids, dtype=torch.long)
        attention_mask[row, : len(ids)] = 1
    return input_ids, attention_mask


#: Head masks were arguments of transformers 4 models; transformers 5 dropped them (its T5 and Llama accept and ignore
#: them). Ignoring a mask a user meant to apply would silently change a result, so ours refuse one.
HEAD_MASK_ARGUMENTS = ("head_mask", "decoder_head_mask", "cross_attn_head_mask")


def reject_head_masks(kwargs: dict) -> None:
    """A ``ValueError`` naming the argument when a head mask is passed (``None`` is accepted and dropped)."""
    for name in HEAD_MASK_ARGUMENTS:
        mask = kwargs.pop(name, None)
        if mask is not None:
            given = describe(mask) if isinstance(mask, torch.Tensor) else type(mask).__name__
            raise ValueError(
                f"`{name}` is not supported (got {given}): head masking was removed in transformers 5 and this model "
                "cannot mask heads; pass None. To study heads, use forward hooks on the attention modules."
            )


def take_cache_argument(past_key_values, kwargs: dict):
    """The key/value cache a model's ``forward`` was given: transformers >= 5.24 passes it as ``cache`` (its
    ``generate()`` uses that name), earlier 5.x releases as ``past_key_values`` (accepted until transformers 5.40).
    ``cache`` is removed from ``kwargs``. Given both (PEFT's prefix tuning passes ``past_key_values`` while
    ``generate()`` passes ``cache``), ``cache`` is used with a warning, as transformers' own models do."""
    cache = kwargs.pop("cache", None)
    if cache is not None and past_key_values is not None:
        import warnings

        warnings.warn("Both `cache` and its older name `past_key_values` were passed: `past_key_values` is ignored.",
                      UserWarning, stacklevel=3)
    return cache if cache is not None else past_key_values


def cache_of(output) -> object:
    """The cache held by a transformers model output: ``output.cache`` from transformers 5.24 on,
    ``output.past_key_values`` before (read without the deprecation warning of the old name)."""
    name = "cache" if "cache" in getattr(type(output), "__dataclass_fields__", {}) else "past_key_values"
    return getattr(output, name, None)


def cache_field(cache) -> dict:
    """``{name: cache}`` for building a transformers model output: ``cache`` from transformers 5.24 on (the old name
    ``past_key_values`` then logs a deprecation warning), ``past_key_values`` before."""
    from transformers.modeling_outputs import Seq2SeqLMOutput

    return {"cache" if "cache" in Seq2SeqLMOutput.__dataclass_fields__ else "past_key_values": cache}
