"""GLM-5.3-Flash (Hugging Face ``model_type`` ``glm5_next``): a hybrid of KDA linear-attention layers
and NoPE MLA layers with a pooled DSA indexer, under hyper-connections, with a MoE FFN
(docs/models.md §9).

Only the configuration exists so far (:mod:`jaxdsa.models.glm5_next.config`); the family is not in
``jaxdsa/models/registry.py`` until its model, parameter spec and cache do.
"""
