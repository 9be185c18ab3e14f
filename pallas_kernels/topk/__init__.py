"""Top-k selection of indexer logits (indices of the k largest finite values)."""
