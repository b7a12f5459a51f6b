"""Model implementations (one file per model) and the blocks they share."""
