"""Sparse MLA: attention of absorbed queries over gathered latent-cache rows."""
