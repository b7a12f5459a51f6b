"""Converters from the original authors' checkpoints (run with ``python -m longreach.conversion.<module>``)."""
