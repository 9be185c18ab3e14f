"""GLM-5.x (``glm_moe_dsa``) and DeepSeek-V3.2 (``deepseek_v32``): MLA + the DSA indexer."""
