"""Matmul with a weight kept quantized (INT4 / FP8-block / FP4), dequantized inside the kernel."""
