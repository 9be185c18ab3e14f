"""MLA's latent projections and what follows them in one kernel: ``q_lat`` and the cached row."""
