"""Model families behind one seam (:mod:`jaxdsa.models.family`), registered by ``model_type``."""
