"""The quantized-weight format as the model code sees it: the part of :mod:`pallas_kernels.quant.layout`
that jaxdsa's layers and loaders use, re-exported so that they import no kernel package.

The format itself (the :class:`QuantizedWeight` pytree, its packers and the layouts of INT4 / FP8 /
FP4 codes and scales) lives beside the kernels that read it, in :mod:`pallas_kernels.quant`;
:mod:`jaxdsa.checkpoints` (which imports no jaxdsa module but :mod:`jaxdsa.progress`) builds
weights from there. Within jaxdsa only these modules import ``pallas_kernels``: the checkpoint walker
(:mod:`jaxdsa.checkpoints.walker`), :mod:`jaxdsa.ops`, this module, :mod:`jaxdsa.cache`
(the FP8 cache formats), and the host-offloaded experts, :mod:`jaxdsa.offload.cpu_moe` (the
kernels' packed layouts, read in place) and :mod:`jaxdsa.offload.host_experts` (the pure-JAX
reference :func:`pallas_kernels.moe.ref.moe_experts`, run on the CPU). The layers reach the kernels
through ops: layers -> ops -> kernels.
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
