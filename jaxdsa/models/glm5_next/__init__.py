"""GLM-5.3-Flash (Hugging Face ``model_type`` ``glm5_next``): a hybrid of KDA linear-attention layers
and NoPE MLA layers with a pooled DSA indexer, under hyper-connections, with a MoE FFN
(docs/models.md §9). The family: :mod:`.family`; config :mod:`.config`, modules :mod:`.model`,
:mod:`.kda`, :mod:`.indexer`, checkpoint names :mod:`.params`.
"""
