"""The ``longreach`` command.

    longreach demo [--output_dir DIR]                      train, evaluate, save and reload a small LOCOST (offline)
    longreach convert {locost,vcc,dodo} OPTIONS...          convert an original checkpoint (the converter's options)
    longreach summarize --model PATH_OR_REPO FILE           summarize a text file ("-": stdin) with any longreach model
    longreach push FOLDER REPO_ID                           upload a saved checkpoint with its code, tokenizer and card
    longreach model-cards [--output_dir model_cards]        regenerate the reference model cards from the templates

Progress goes to stderr, results to stdout.
"""

from __future__ import annotations

import argparse
import importlib
import sys
import time
import warnings

#: ``longreach convert NAME`` -> the converter module (imported only when that converter is used).
CONVERTERS = {
    "locost": "longreach.conversion.convert_locost_original_checkpoint",
    "vcc": "longreach.conversion.convert_vcc_original_checkpoint",
    "dodo": "longreach.conversion.convert_dodo_original_checkpoint",
}


def _progress(message: str, end: str = "\n") -> None:
    print(message, file=sys.stderr, end=end, flush=True)


# ---------------------------------------------------------------------------------------------------------------------
# convert
# ---------------------------------------------------------------------------------------------------------------------


def convert(argv: list[str]) -> int:
    """``longreach convert NAME ARGS...``: run the converter's own ``main(ARGS)``."""
    if not argv or argv[0] in ("-h", "--help"):
        print(
            "usage: longreach convert {" + ",".join(CONVERTERS) + "} [converter options]\n\n"
            "Convert a checkpoint written by the authors' original code into a Hub-ready longreach folder.\n"
            "`longreach convert NAME --help` lists that converter's options.",
            file=sys.stdout if argv else sys.stderr,
        )
        return 0 if argv else 2
    name, converter_argv = argv[0], argv[1:]
    if name not in CONVERTERS:
        print(f"error: unknown converter {name!r}; choose one of {sorted(CONVERTERS)}.", file=sys.stderr)
        return 2
    try:
        module = importlib.import_module(CONVERTERS[name])
    except ModuleNotFoundError as error:
        if error.name != CONVERTERS[name]:
            raise
        print(f"error: the {name} converter ({CONVERTERS[name]}) is not part of this longreach installation.",
              file=sys.stderr)
        return 1
    program, sys.argv[0] = sys.argv[0], f"longreach convert {name}"  # the converter's --help names this command
    try:
        return module.main(converter_argv)
    finally:
        sys.argv[0] = program


# ---------------------------------------------------------------------------------------------------------------------
# summarize
# ---------------------------------------------------------------------------------------------------------------------


def _generation_progress(max_new_tokens: int | None):
    """A stopping criterion that never stops generation and reports how many tokens were generated (stderr)."""
    import torch
    from transformers import StoppingCriteria

    class GenerationProgress(StoppingCriteria):
        def __init__(self):
            self.start_length, self.start_time = None, time.perf_counter()

        def __call__(self, input_ids, scores, **kwargs):
            if self.start_length is None:
                self.start_length = input_ids.shape[1] - 1
            generated = input_ids.shape[1] - self.start_length
            total = f"/{max_new_tokens}" if max_new_tokens else ""
            _progress(f"\rgenerating: {generated}{total} tokens ({time.perf_counter() - self.start_time:.1f}s)", end="")
            return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)

    return GenerationProgress()


def load_summarizer(model_path: str, tokenizer_path: str | None = None, device: str | None = None,
                    dtype: str | None = None):
    """A ``LongSummarizationPipeline`` for a LOCOST, VCC-T5 or Dodo checkpoint (folder or Hub id)."""
    import longreach  # noqa: F401  (registers the model classes)
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForSeq2SeqLM, AutoTokenizer

    from .pipelines.pipeline_summarization import LongSummarizationPipeline

    config = AutoConfig.from_pretrained(model_path, trust_remote_code=True)
    auto_class = AutoModelForSeq2SeqLM if config.is_encoder_decoder else AutoModelForCausalLM
    model = auto_class.from_pretrained(model_path, trust_remote_code=True, dtype=dtype or "auto")
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_path or model_path)
    return LongSummarizationPipeline(model=model, tokenizer=tokenizer, device=device)


def summarize(args: argparse.Namespace) -> int:
    start = time.perf_counter()
    if args.file == "-":
        document = sys.stdin.read()
    else:
        try:
            with open(args.file, encoding="utf-8") as handle:
                document = handle.read()
        except OSError as error:
            print(f"error: cannot read {args.file!r}: {error.strerror}", file=sys.stderr)
            return 1
    if not document.strip():
        print(f"error: {args.file!r} holds no text to summarize.", file=sys.stderr)
        return 1
    _progress(f"loading {args.model} ...")
    summarizer = load_summarizer(args.model, args.tokenizer, args.device, args.dtype)
    model = summarizer.model
    num_tokens = len(summarizer.tokenizer(document)["input_ids"])
    _progress(f"{type(model).__name__} ({model.config.model_type}, {model.num_parameters() / 1e6:.1f}M parameters) "
              f"loaded in {time.perf_counter() - start:.1f}s; document: {len(document)} characters, {num_tokens} tokens")

    generate_kwargs = {}
    for name in ("max_new_tokens", "num_beams", "length_penalty", "no_repeat_ngram_size"):
        if getattr(args, name) is not None:
            generate_kwargs[name] = getattr(args, name)
    from transformers import StoppingCriteriaList

    max_new_tokens = generate_kwargs.get("max_new_tokens", model.generation_config.max_new_tokens)
    generate_kwargs["stopping_criteria"] = StoppingCriteriaList([_generation_progress(max_new_tokens)])
    call_kwargs = {"max_input_length": args.max_input_length} if args.max_input_length else {}
    with warnings.catch_warnings(record=True) as caught:  # shown as one line each (dropped tokens, ...)
        warnings.simplefilter("always", UserWarning)
        summary = summarizer(document, **call_kwargs, **generate_kwargs)[0]["summary_text"]
    _progress(f"\ndone in {time.perf_counter() - start:.1f}s")
    for warning in caught:
        _progress(f"warning: {warning.message}")
    if args.output:
        with open(args.output, "w", encoding="utf-8") as handle:
            handle.write(summary + "\n")
        _progress(f"summary written to {args.output}")
    else:
        print(summary)
    return 0


# ---------------------------------------------------------------------------------------------------------------------
# push, model-cards, demo
# ---------------------------------------------------------------------------------------------------------------------


def push(args: argparse.Namespace) -> int:
    from .hub import push_folder_to_hub

    try:
        commit = push_folder_to_hub(args.folder, args.repo_id, private=args.private or None,
                                    commit_message=args.commit_message)
    except ValueError as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    print(getattr(commit, "commit_url", commit))
    return 0


def model_cards(args: argparse.Namespace) -> int:
    from .hub import write_reference_model_cards

    for path in write_reference_model_cards(args.output_dir):
        print(path)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="longreach", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__.split("\n\n")[1])
    commands = parser.add_subparsers(dest="command", metavar="{demo,convert,summarize,push,model-cards}")

    demo = commands.add_parser("demo", help="Train, evaluate, save and reload a small LOCOST summarizer, offline.",
                               add_help=False)
    demo.add_argument("demo_args", nargs=argparse.REMAINDER)
    commands.add_parser("convert", help="Convert an original LOCOST / VCC-T5 / Dodo checkpoint.", add_help=False)

    summarize_parser = commands.add_parser("summarize", help="Summarize a text file with a longreach model.")
    summarize_parser.add_argument("--model", required=True, help="Model folder or Hub repository id.")
    summarize_parser.add_argument("file", help="Text file to summarize ('-' reads stdin).")
    summarize_parser.add_argument("--tokenizer", default=None, help="Tokenizer (default: the model's folder).")
    summarize_parser.add_argument("--max_new_tokens", type=int, default=None)
    summarize_parser.add_argument("--num_beams", type=int, default=None)
    summarize_parser.add_argument("--length_penalty", type=float, default=None)
    summarize_parser.add_argument("--no_repeat_ngram_size", type=int, default=None)
    summarize_parser.add_argument("--max_input_length", type=int, default=None,
                                  help="Keep at most this many document tokens (a warning reports what is dropped).")
    summarize_parser.add_argument("--device", default=None, help="e.g. cpu, cuda, cuda:1 (default: cuda if present).")
    summarize_parser.add_argument("--dtype", default=None, help="e.g. float32, bfloat16 (default: the checkpoint's).")
    summarize_parser.add_argument("--output", default=None, help="Write the summary to this file instead of stdout.")

    push_parser = commands.add_parser("push", help="Upload a saved checkpoint folder with our model card.")
    push_parser.add_argument("folder")
    push_parser.add_argument("repo_id")
    push_parser.add_argument("--private", action="store_true")
    push_parser.add_argument("--commit_message", default=None)

    cards = commands.add_parser("model-cards", help="Regenerate model_cards/*.md from the templates.")
    cards.add_argument("--output_dir", default="model_cards")
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "convert":  # everything after the converter name belongs to the converter
        return convert(argv[1:])
    if argv and argv[0] == "demo":
        from .demo import main as demo_main

        return demo_main(argv[1:])
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command == "summarize":
        return summarize(args)
    if args.command == "push":
        return push(args)
    if args.command == "model-cards":
        return model_cards(args)
    parser.print_help(sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
