"""Model configurations (one file per model)."""
