"""The quantized-weight formats (INT4 / FP8-block / FP4 / NVFP4), shared by every kernel that reads them.

- :mod:`.layout`: the :class:`~.layout.QuantizedWeight` pytree, the packers, padding and
  regrouping, and ``dequantize`` (each format's definition, what the kernels' references use);
- :mod:`.decode`: e4m3 / e2m1 / ue8m0 / INT4 decoding inside a kernel (NVFP4: e2m1 codes, e4m3
  scales), and the switches that choose its path per GPU;
- :mod:`.tiles`: reading a weight tile (dense or quantized) in a kernel's K loop.

``quant_matmul`` and the MoE kernels read weights through :mod:`.tiles`; the indexer decodes its
fp8 keys with :mod:`.decode`. Model code takes the type from :mod:`jaxdsa.quantized_weight`.
"""
