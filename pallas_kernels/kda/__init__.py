"""Kimi Delta Attention (KDA), GLM-5.3-Flash's linear attention: short causal conv + gated delta rule."""
