"""The quantized-weight format as the model code sees it: the part of :mod:`pallas_kernels.quant.layout`
that jaxdsa's layers and loaders use, re-exported so that they import no kernel package.

The format itself (the :class:`QuantizedWeight` pytree, its packers and the layouts of INT4 / FP8 /
FP4 codes and scales) lives beside the kernels that read it, in :mod:`pallas_kernels.quant`;
``checkpoints`` (which jaxdsa imports, never the reverse) builds weights from there. Within jaxdsa
only :mod:`jaxdsa.ops`, this module and :mod:`jaxdsa.cache` (the FP8 cache formats) import
``pallas_kernels``: layers -> ops -> kernels.
"""

from pallas_kernels.quant.layout import (
    QuantizedWeight,
    codes_dtype,
    codes_per_element,
    default_kpack,
    dequantize,
    take_layer,
)

__all__ = ["QuantizedWeight", "codes_dtype", "codes_per_element", "default_kpack", "dequantize", "take_layer"]
