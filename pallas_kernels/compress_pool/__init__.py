"""DeepSeek-V4 KV compressor: gated per-channel softmax pooling of windows, then RMSNorm."""
