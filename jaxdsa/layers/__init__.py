"""Building blocks of the GLM-5.x / DeepSeek-V3.2 decoder, as pure functions over param dicts."""
