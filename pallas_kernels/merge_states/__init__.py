"""Log-sum-exp merge of partial attention states, with an optional per-head sink."""
