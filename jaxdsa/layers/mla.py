"""Multi-head latent attention (MLA) with the DSA indexer in two equivalent forms (docs/models.md §2.4, §2.5).

- naive ("MHA"): expand each cached latent through W_UK / W_UV into per-head keys and values;
  cheaper for long prefills, used for single-sequence prefill steps.
- absorbed ("MQA"): fold W_UK into the query (q_nope . W_UK) and attend over the 576-wide latent
  rows directly through :func:`jaxdsa.ops.sparse_mla`, then apply W_UV; used for decode and for
  every batched step.

Shapes (legend in docs/architecture.md; H heads, C kv_lora_rank, Pr rope dim, Dn nope dim, Dv value
dim, D model dim): q_a [D, q_lora], q_b [q_lora, H, Dn+Pr], kv_a [D, C+Pr], w_uk [C, H, Dn],
w_uv [C, H, Dv], o [H, Dv, D]. Each token caches one row [normed latent (C) | roped key (Pr)].

``w_uk`` and ``w_uv`` are the two parts of each head's rows of ``kv_b``, each a :class:`Linear`.
The absorbed form multiplies each head by its own slice (:meth:`Linear.dense`), which no quantized
matmul expresses, so with ``dense_kv_b`` (the default) they are held in the model dtype (a
checkpoint's FP8 / INT4 ``kv_b`` dequantized at load, as vLLM does): dequantizing them in every step
cost a decode step two XLA fusions of ~3.5 us per layer. Without it (dp attention, where every
device holds every head's, 8x the bytes on 8 GPUs) they stay quantized and are dequantized in the
step; the naive form runs them as matmuls of the latent rows either way.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from jaxdsa import ops
from jaxdsa.cache import Cache, LayerPages, kv_fp8, slots_for
from jaxdsa.layers.context import StepContext
from jaxdsa.layers.indexer import Indexer
from jaxdsa.layers.linear import Linear, project
from jaxdsa.layers.norms import StackedRMSNorm
from jaxdsa.layers.rope import apply_rope
from jaxdsa.layers.stacks import split_layer
from jaxdsa.quantized_weight import QuantizedWeight
from jaxdsa.sharding import reduce_partials


@dataclasses.dataclass
class LatentPages:
    """One layer's cached latent rows under the cache entry ``name``: whole rows in the model's
    dtype (``rows`` only), or the FP8 parts (:mod:`pallas_kernels.quant.kv_fp8`): e4m3 values in
    ``rows``, their ``scales`` (``{name}_scales``; float32 per 128 for GLM / V3.2's DS_MLA, ue8m0
    bytes per 64 for V4's MODEL1: the scales' dtype says which) and the bf16 ``rope`` part
    (``{name}_rope``), each an array of its own."""

    rows: LayerPages
    scales: LayerPages | None = None
    rope: LayerPages | None = None
    name: str = "latent"

    @classmethod
    def of(cls, cache: Cache, layer, name: str = "latent") -> LatentPages:
        if f"{name}_scales" not in cache:
            return cls(LayerPages(cache[name], layer), name=name)
        parts = (cache[k] for k in (name, f"{name}_scales", f"{name}_rope"))
        return cls(*(LayerPages(a, layer) for a in parts), name=name)

    @property
    def parts(self) -> tuple[LayerPages, ...]:
        return (self.rows,) if self.scales is None else (self.rows, self.scales, self.rope)

    @property
    def page_size(self) -> int:
        return self.rows.page_size

    def _quantize(self, rows: jax.Array) -> tuple[jax.Array, ...]:
        fmt = kv_fp8.latent_format(self.scales.stacked.dtype)
        return fmt.quantize(rows, self.rows.stacked.shape[-1])

    def write(self, slots: jax.Array, rows: jax.Array) -> LatentPages:
        """Store ``rows [T, C+Pr]`` at ``slots`` (-1 dropped): as they are, or quantized."""
        if self.scales is None:
            return dataclasses.replace(self, rows=self.rows.write(slots, rows))
        written = (p.write(slots, v) for p, v in zip(self.parts, self._quantize(rows)))
        return LatentPages(*written, name=self.name)

    def read_back(self, rows: jax.Array) -> jax.Array:
        """``rows`` as a reader of these pages sees them once written: themselves, or FP8 rows
        dequantized into ``rows``' dtype (exact: an e4m3 value times a power of two is a bf16)."""
        if self.scales is None:
            return rows
        return kv_fp8.dequantize_latent(*self._quantize(rows)).astype(rows.dtype)

    def flat(self, slots: jax.Array) -> tuple[tuple[jax.Array, ...], jax.Array]:
        """Every layer's parts seen flat ``[L*P*page, w]`` and ``slots`` moved into this layer."""
        seen = [p.rows(slots) for p in self.parts]  # every part moves the slots alike
        return tuple(flat for flat, _ in seen), seen[0][1]

    def entries(self) -> Cache:
        names = (self.name, f"{self.name}_scales", f"{self.name}_rope")
        return {name: p.stacked for name, p in zip(names, self.parts)}


class StackedLinear(Linear):
    """A linear whose weight a kernel reads in its layer stack, dense or not (``w_uk``:
    :func:`jaxdsa.ops.mla_query`): scanned, the weight reaches the layer whole (:meth:`stack_reads`);
    XLA's own products with it take the layer's slice (:meth:`Linear.dense`)."""

    def stack_reads(self) -> tuple[str, ...]:
        return ("weight",)


def fp8_parts(parts: tuple[jax.Array, ...]) -> dict[str, jax.Array]:
    """:func:`jaxdsa.ops.sparse_mla`'s keyword arguments for :meth:`LatentPages.flat`'s parts after
    the first (none for rows in the model's dtype)."""
    return dict(zip(("kv_scale", "kv_rope"), parts[1:]))


class MLAttention(nnx.Module):
    """``heads`` may include zero-padded heads (their q and o rows are 0: they add nothing)."""

    def __init__(
        self,
        *,
        hidden: int,
        heads: int,
        q_lora: int,
        kv_lora: int,
        nope: int,
        rope: int,
        v: int,
        softmax_scale: float,
        latent_norm_eps: float,
        indexer: Indexer | None,
        dtype,
        rngs: nnx.Rngs,
        dense_kv_b: bool = True,
    ):
        self.q_a = Linear((hidden,), (q_lora,), ("embed", "q_lora"), dtype=dtype, rngs=rngs)
        self.q_a_norm = StackedRMSNorm(q_lora, latent_norm_eps, axis="q_lora", dtype=dtype)
        self.q_b = Linear(
            (q_lora,), (heads, nope + rope), ("q_lora", "heads", "head_dim"), dtype=dtype, rngs=rngs
        )
        self.kv_a = Linear((hidden,), (kv_lora + rope,), ("embed", "latent"), dtype=dtype, rngs=rngs)
        self.kv_a_norm = StackedRMSNorm(kv_lora, latent_norm_eps, axis="kv_lora", dtype=dtype)
        absorbed = dict(dtype=dtype, rngs=rngs, quantizable=not dense_kv_b)
        self.w_uk = StackedLinear((kv_lora,), (heads, nope), ("kv_lora", "heads", "head_dim"), **absorbed)
        self.w_uv = Linear((kv_lora,), (heads, v), ("kv_lora", "heads", "head_dim"), **absorbed)
        self.o = Linear((heads, v), (hidden,), ("heads", "head_dim", "embed"), dtype=dtype, rngs=rngs)
        self.indexer = indexer
        self.kv_lora, self.nope, self.softmax_scale = kv_lora, nope, softmax_scale

    def project_latent(self, x: jax.Array, wk: tuple[Linear, ...], cos, sin) -> list[jax.Array]:
        """The layer input's latent projections and what follows them: ``q_lat [T, q_lora]`` (normed;
        also the indexer's input), the tokens' cached rows [T, C+Pr] (:meth:`latent_rows`) and,
        with the indexer's ``wk``, its product. Quantized alike, one op adds the projections' K
        splits and applies both norms and the latent key's RoPE (:func:`jaxdsa.ops.mla_latent`: at
        decode three XLA reductions and a scaling fewer); anything else, XLA's ops."""
        quantized = lambda m: isinstance(split_layer(m.weight.get_value())[0], QuantizedWeight)  # noqa: E731
        joined = tuple(w for w in wk if quantized(w))  # a dense wk beside them runs on its own
        if len(joined) > 1 or cos.shape[-1] == 0:  # the kernel joins one more projection, after RoPE
            joined = ()
        stacks, layers = zip(*(split_layer(m.weight.get_value()) for m in (self.q_a, self.kv_a, *joined)))
        norms, norm_layers = zip(
            *(split_layer(n.weight.get_value()) for n in (self.q_a_norm, self.kv_a_norm))
        )
        if (
            all(isinstance(w, QuantizedWeight) for w in stacks)
            and all(layer is layers[0] for layer in (*layers, *norm_layers))
            and self.q_a_norm.eps == self.kv_a_norm.eps
        ):
            out = ops.mla_latent(x, stacks, *norms, cos, sin, eps=self.q_a_norm.eps, layer=layers[0])
            return [*out, *(w(x) for w in wk if w not in joined)]
        q_a, kv, *wk_x = project(x, (self.q_a, self.kv_a, *wk))
        return [self.q_a_norm(q_a), self.latent_rows(kv, cos, sin), *wk_x]

    def queries(self, q_lat: jax.Array, cos, sin):
        """``q_lat``: the tokens' normed ``q_a`` projection -> q_nope [T,H,Dn], q_pe [T,H,Pr] (roped)."""
        q = self.q_b(q_lat)
        q_nope, q_pe = q[..., : self.nope], q[..., self.nope :]
        return q_nope, apply_rope(q_pe, cos, sin, interleaved=True)

    def absorbed_queries(self, q_lat: jax.Array, cos, sin) -> jax.Array:
        """The absorbed form's queries from ``q_lat``: ``[q_nope W_UK | q_pe]`` per head -> [T, H, C+Pr].
        With ``q_b`` quantized and decode-sized T one op builds them after ``q_b``'s launch
        (:func:`jaxdsa.ops.mla_query`: at decode the K splits' sum, the W_UK reduction and the
        concatenation, three XLA launches, become one kernel); anything else, XLA's ops."""
        q_b, layer = split_layer(self.q_b.weight.get_value())
        w_uk, w_uk_layer = split_layer(self.w_uk.weight.get_value())
        if (
            isinstance(q_b, QuantizedWeight)
            and not isinstance(w_uk, QuantizedWeight)  # dense unless dp attention keeps kv_b quantized
            and w_uk_layer is layer  # one index for both stacks (one scanned layer), or both unrolled
            and q_lat.shape[0] <= ops.MLA_QUERY_MAX_TOKENS
        ):
            return ops.mla_query(q_lat, q_b, w_uk, cos, sin, nope=self.nope, layer=layer)
        q_nope, q_pe = self.queries(q_lat, cos, sin)
        q_abs = jnp.einsum("thn,chn->thc", q_nope, self.w_uk.dense(q_nope.dtype))
        return jnp.concatenate([q_abs, q_pe.astype(q_abs.dtype)], axis=-1)

    def latent_rows(self, kv: jax.Array, cos, sin) -> jax.Array:
        """The cached row of each token from its ``kv_a`` projection: [normed latent (C) | roped
        shared key (Pr)] -> [T, C+Pr]."""
        latent = self.kv_a_norm(kv[:, : self.kv_lora])
        k_pe = apply_rope(kv[:, self.kv_lora :], cos, sin, interleaved=True)
        return jnp.concatenate([latent, k_pe], axis=-1)

    def __call__(
        self,
        x: jax.Array,
        ctx: StepContext,
        latent: LatentPages,
        index_keys,
        prev_topk: jax.Array | None,
    ):
        """-> (out [T, D] float32, latent, index_keys, topk key positions [T, K] or None). ``index_keys``:
        what the indexer keeps in the cache (:meth:`Indexer.update`; None without one). ``out`` is
        the all-reduced sum of the output projection's shards, left in float32 for the next
        residual add to round (one kernel fewer than a cast of its own). An FP8 latent cache
        (:class:`LatentPages`) is quantized as it is written and decoded where it is read."""
        meta, page_size = ctx.meta, latent.rows.page_size
        slots = slots_for(meta.page_table, meta.seq_ids, ctx.positions, page_size)
        # the projections of the layer input in one kernel launch when they are quantized alike
        wk = self.indexer.projections() if self.indexer is not None else ()
        q_lat, row, *wk_x = self.project_latent(x, wk, ctx.cos, ctx.sin)
        latent = latent.write(slots, row)
        topk = prev_topk if ctx.sparse else None
        if self.indexer is not None:
            index_keys, topk = self.indexer.update(x, q_lat, wk_x, ctx, index_keys, slots)
        elif ctx.sparse and topk is None:
            raise ValueError("a shared-indexer layer needs an earlier full layer's top-k")

        key_positions = jnp.arange(meta.page_table.shape[1] * page_size, dtype=jnp.int32)
        if ctx.absorbed:
            if ctx.sparse:
                positions = topk
            else:
                positions = jnp.where(
                    key_positions[None, :] <= ctx.positions[:, None], key_positions[None, :], -1
                )
            parts, indices = latent.flat(
                slots_for(meta.page_table, meta.seq_ids[:, None], positions, page_size)
            )
            o = self.absorbed_attention(self.absorbed_queries(q_lat, ctx.cos, ctx.sin), parts, indices)
        else:
            if meta.page_table.shape[0] != 1:
                raise ValueError("the naive MLA form runs single-sequence steps (page_table with one row)")
            parts, key_slots = latent.flat(
                slots_for(meta.page_table, jnp.zeros_like(key_positions), key_positions, page_size)
            )
            mask = (key_positions[None, :] <= ctx.positions[:, None]) & (meta.seq_ids[:, None] >= 0)
            if ctx.sparse:
                picked = jnp.where(topk >= 0, topk, mask.shape[1])  # -1 (none) out of range: dropped
                selected = (
                    jnp.zeros(mask.shape, bool)
                    .at[jnp.arange(mask.shape[0])[:, None], picked]
                    .set(True, mode="drop")
                )
                mask &= selected
            keys = [p[key_slots] for p in parts]
            # FP8: this sequence's rows, dequantized as they are expanded through w_uk / w_uv anyway
            keys = keys[0] if len(keys) == 1 else kv_fp8.dequantize_latent(*keys).astype(x.dtype)
            o = self.naive_attention(*self.queries(q_lat, ctx.cos, ctx.sin), keys, mask)
        return reduce_partials(self.o.unreduced(o)), latent, index_keys, topk

    def naive_attention(self, q_nope, q_pe, keys: jax.Array, mask: jax.Array) -> jax.Array:
        """Expanded-KV attention. keys [S, C+Pr] latent rows, mask [T, S] bool -> o [T, H, Dv]."""
        latent, k_pe = keys[:, : self.kv_lora], keys[:, self.kv_lora :]
        k_nope, v = self.w_uk(latent), self.w_uv(latent)
        k = jnp.concatenate(
            [k_nope, jnp.broadcast_to(k_pe[:, None, :], k_nope.shape[:2] + k_pe.shape[-1:])], axis=-1
        )
        q = jnp.concatenate([q_nope, q_pe], axis=-1)
        # jax.nn.dot_product_attention needs equal q/k and v widths: zero-pad the narrower side.
        width = max(q.shape[-1], v.shape[-1])
        pad = lambda a: jnp.pad(a, ((0, 0), (0, 0), (0, width - a.shape[-1])))
        o = jax.nn.dot_product_attention(
            pad(q)[None], pad(k)[None], pad(v)[None], mask=mask[None, None], scale=self.softmax_scale
        )
        return o[0, ..., : v.shape[-1]]

    def absorbed_attention(self, q: jax.Array, kv: tuple[jax.Array, ...], indices: jax.Array) -> jax.Array:
        """Latent-space attention over cache slots.

        q [T, H, C+Dr] (:meth:`absorbed_queries`); kv: rows [Z, C+Dr], or the FP8 parts (values [Z, C],
        scales [Z, C/128], rope [Z, Dr]); indices [T, K] (-1 skip) -> o [T,H,Dv]."""
        out, _ = ops.sparse_mla(
            q, kv[0], indices, sm_scale=self.softmax_scale, v_dim=self.kv_lora, **fp8_parts(kv)
        )
        return jnp.einsum("thc,chv->thv", out, self.w_uv.dense(out.dtype))
