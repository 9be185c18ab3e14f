"""RMSNorm with the residual add before it, in one kernel (a decoder layer's two norms)."""
