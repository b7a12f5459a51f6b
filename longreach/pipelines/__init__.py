"""Pipelines (registered by ``import longreach``)."""
