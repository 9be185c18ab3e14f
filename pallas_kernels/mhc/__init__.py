"""Manifold-constrained hyper-connections (DeepSeek-V4): stream mixing weights with Sinkhorn."""
