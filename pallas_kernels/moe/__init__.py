"""MoE routed-expert SwiGLU MLP over the experts a batch touches."""
