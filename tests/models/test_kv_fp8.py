"""The FP8 KV cache (``kv_cache_dtype="fp8"``) against its own definition.

``golden_kv_fp8.npz`` (tests/reference/make_kv_fp8_goldens.py, make_kv_fp8_goldens_v4.py) holds HF's
float32 logits with every cached latent row (V4: window row and compressed entry) and index key passed
through the released engines' quantize / dequantize (torch, written apart from jaxdsa's writer):
jaxdsa's fp8 cache must give the same logits within 1e-4 rel-L2 and the same greedy tokens, through
the pure-JAX ops, the Pallas kernels in the interpreter (the sm_80 integer decoders: the
interpreter's default), and meshes (tests/sharding/test_kv_fp8_mesh.py). The distance to the float
cache's goldens is reported by the fixture READMEs, not bounded here.
"""

import jax.numpy as jnp
import numpy as np
import pytest

import jaxdsa
from benchmarks.model_check import stable_rows
from jaxdsa import ops
from pallas_kernels.quant import kv_fp8
from tests.conftest import FIXTURES
from tests.models.test_hf_parity import TOLERANCE, rel_l2
from tests.models.test_mla_forms import _run

# Left out of the default run (tests/conftest.py; pytest -m slow runs them): GLM-5.2, V3.2 and the V4
# FP8-weight fixture, V4 through the interpreted kernels, V4's chunks and drafts: the default run checks
# GLM-5 through the ops and the interpreted kernels, V4 through the ops, chunks, prefix hits and drafts on
# GLM-5.2.
SLOW_CASES = (
    "test_the_fp8_cache_matches_its_reference[dsv4-interpret]",
    "test_the_fp8_cache_matches_its_reference[dsv4_fp8-reference]",
    "test_the_fp8_cache_matches_its_reference[glm52-*]",
    "test_the_fp8_cache_matches_its_reference[dsv32-reference]",
    "test_v4_chunks_and_drafts_on_fp8_rows",
)

FIXTURE_NAMES = ["glm5", "glm52", "dsv32", "dsv4", "dsv4_fp8"]


def fp8_llm(name: str, **options) -> jaxdsa.LLM:
    return jaxdsa.LLM(
        FIXTURES / name, dtype="float32", page_size=8, kv_cache_dtype="fp8", progress=False, **options
    )


def golden(name: str) -> dict[str, np.ndarray]:
    return dict(np.load(FIXTURES / name / "golden_kv_fp8.npz"))


def assert_matches(llm: jaxdsa.LLM, want: dict[str, np.ndarray], prompts=("short", "long")) -> None:
    """The goldens' prompts scored and the greedy prompt generated; V4 adds its mid-length prompt.
    Rows that move by the tolerance or more when the reference's quantizer inputs move by about one
    float32 ulp (``ulp_sensitivity_*``, V4's goldens: an e4m3 rounding decision that close to a tie,
    as in dsv4_fp8's long prompt) are not compared: two exact implementations may round them apart."""
    prompts = (*prompts, *(("mid",) if "prompt_mid" in want and "long" in prompts else ()))
    for prompt in prompts:
        got, ref = llm.score(want[f"prompt_{prompt}"].tolist()), want[f"logits_{prompt}"]
        stable = stable_rows(want, prompt, TOLERANCE)
        assert stable.sum() >= min(len(ref), 10), prompt
        assert rel_l2(got[stable], ref[stable]).max() <= TOLERANCE, prompt
    n = len(want["greedy_tokens"])
    tokens, logits = llm.generate([want["greedy_prompt"].tolist()], max_new_tokens=n, return_logits=True)
    assert tokens[0] == want["greedy_tokens"].tolist()
    assert rel_l2(logits[0], want["greedy_logits"]).max() <= TOLERANCE


@pytest.mark.parametrize(
    "name, backend",
    [(n, "reference") for n in FIXTURE_NAMES] + [(n, "interpret") for n in ("glm5", "glm52", "dsv4")],
)
def test_the_fp8_cache_matches_its_reference(name, backend):
    previous = ops.get_kernels()
    ops.set_kernels(backend)
    try:
        llm = fp8_llm(name)
        rows = "window" if name.startswith("dsv4") else "latent"
        assert llm.engine.runner.cache[rows].dtype == jnp.float8_e4m3fn
        assert_matches(llm, golden(name))
    finally:
        ops.set_kernels(previous)


def test_the_cache_holds_the_released_layouts(tiny_llms):
    """656 bytes a latent row and 128 e4m3 + one float32 per index key at the released widths."""
    from jaxdsa.models.registry import released_config

    llm = tiny_llms["glm5"]
    for preset, layers, indexers in (("glm5", 78, 78), ("glm52", 78, 21), ("dsv32", 61, 61)):
        spec = llm.family.cache_spec(released_config(preset), "fp8")
        assert spec.bytes_per_token(jnp.bfloat16, 64) == layers * 656 + indexers * 132, preset
    entries = llm.family.cache_spec(llm.config, "fp8").entries
    parts = {name: (e.width, jnp.dtype(e.dtype).name) for name, e in entries.items()}
    assert parts == {
        "latent": (128, "float8_e4m3fn"),
        "latent_scales": (1, "float32"),
        "latent_rope": (8, "bfloat16"),
        "index_keys": (32, "float8_e4m3fn"),
        "index_scales": (1, "float32"),
    }
    assert kv_fp8.latent_bytes(128, 8) == 128 + 4 + 16


@pytest.mark.parametrize("sparse", [False, True])
def test_the_two_mla_forms_read_the_same_fp8_rows(tiny_llms, sparse):
    llm = tiny_llms["glm5"]
    ids = np.random.default_rng(3).integers(0, llm.config.vocab_size, 24 if sparse else 8)
    naive = _run(llm, ids, sparse=sparse, absorbed=False, kv_format="fp8")
    absorbed = _run(llm, ids, sparse=sparse, absorbed=True, kv_format="fp8")
    assert rel_l2(absorbed, naive).max() < 1e-5
    assert rel_l2(naive, _run(llm, ids, sparse=sparse, absorbed=False)).max() > 1e-3  # the rows are fp8


def test_chunks_prefix_hits_and_drafts_on_fp8_rows():
    """Chunked prefill, a prefix-cache hit and MTP drafts (rolled back where rejected) over fp8 rows
    give the reference's greedy tokens."""
    want = golden("glm52")
    prompt, n = want["greedy_prompt"].tolist(), len(want["greedy_tokens"])
    llm = fp8_llm("glm52", max_num_batched_tokens=5, speculative_config={"num_speculative_tokens": 2})
    for _ in range(2):  # the second run finds the first's pages in the prefix cache
        assert llm.generate([prompt], max_new_tokens=n)[0] == want["greedy_tokens"].tolist()
    stats = llm.engine.stats()
    assert stats["prefix_cache_hits"] > 0
    assert llm.engine.runner.mtp_cache["latent_rope"].dtype == jnp.bfloat16


def test_the_v4_cache_holds_the_released_layouts():
    """MODEL1 rows (448 e4m3, 7 ue8m0 scale bytes, 64 bf16 rope: 583 bytes of FlashMLA's 584-byte record)
    for the window and compressed entries, 132-byte index keys; the compressors' state stays float32."""
    from jaxdsa.models.deepseek_v4.family import FAMILY as family
    from jaxdsa.models.registry import load_config, released_config

    spec = family.cache_spec(released_config("v4-flash"), "fp8").entries
    row = lambda name: sum(  # noqa: E731
        spec[n].width * jnp.dtype(spec[n].dtype).itemsize for n in (name, f"{name}_scales", f"{name}_rope")
    )
    assert row("window") == row("csa_entries") == row("hca_entries") == 448 + 7 + 128
    assert spec["index_keys"].width + 4 * spec["index_scales"].width == 128 + 4
    assert spec["csa_state"].dtype == jnp.float32 == spec["index_state"].dtype
    tiny = family.cache_spec(load_config(FIXTURES / "dsv4"), "fp8").entries
    parts = {name: (e.width, jnp.dtype(e.dtype).name) for name, e in tiny.items() if "state" not in name}
    assert parts == {  # head_dim 32 = 24 nope (one tile, narrower than 64) + 8 rope
        **{n: (24, "float8_e4m3fn") for n in ("window", "csa_entries", "hca_entries")},
        **{f"{n}_scales": (1, "uint8") for n in ("window", "csa_entries", "hca_entries")},
        **{f"{n}_rope": (8, "bfloat16") for n in ("window", "csa_entries", "hca_entries")},
        "index_keys": (16, "float8_e4m3fn"),
        "index_scales": (1, "float32"),
    }


def test_v4_chunks_and_drafts_on_fp8_rows():
    """V4's rings over fp8 rows: prefill chunks of 3 tokens (so windows and compression boundaries
    fall inside chunks and across them) and MTP drafts give the reference's greedy tokens."""
    want = golden("dsv4")
    prompt, n = want["greedy_prompt"].tolist(), len(want["greedy_tokens"])
    llm = fp8_llm("dsv4", max_num_batched_tokens=3, speculative_config={"num_speculative_tokens": 2})
    assert llm.generate([prompt], max_new_tokens=n)[0] == want["greedy_tokens"].tolist()
    assert llm.engine.runner.mtp_cache["window_scales"].dtype == jnp.uint8


def test_fp8_rows_are_read_back_from_their_bytes():
    """Dequantizing decodes the e4m3 and bf16 bits rather than converting them to float32: XLA:GPU
    folds a convert chain such as f32 -> e4m3 -> f32 back to its input, so a row quantized and read
    back in one step (V4's step rows) came back unquantized on the H200 while the CPU kept it."""
    import re

    import jax

    read_back = jax.jit(lambda x: kv_fp8.dequantize_latent(*kv_fp8.MODEL1.quantize(x, 24)))
    x = np.random.default_rng(0).normal(size=(3, 32)).astype(np.float32)
    hlo = read_back.lower(x).as_text()
    assert not re.search(r"stablehlo\.convert %\S+ : \(tensor<[^>]*(f8E4M3FN|bf16)>\)", hlo)
    values, scales, rope = kv_fp8.MODEL1.quantize(x, 24)
    want = np.asarray(values, np.float32) * 2.0 ** (np.asarray(scales, np.float32) - 127)
    got = np.asarray(read_back(x))
    np.testing.assert_array_equal(got[:, :24], want)
    np.testing.assert_array_equal(got[:, 24:], np.asarray(rope, np.float32))
