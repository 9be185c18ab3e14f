"""benchmarks/quant.py end to end on the CPU at tiny shapes (interpret mode): every format's rows are
checked against the float32 reference and timed, and the results file is written; two processes'
JSON dumps merge into one file."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from benchmarks import quant
from pallas_kernels.quant.layout import WORD_KPACK
from pallas_kernels.quant_matmul.tuning import GEMV_ENV


def test_small_run_writes_a_report(tmp_path, monkeypatch):
    monkeypatch.delenv("QUANT_TOKENS", raising=False)
    monkeypatch.delenv("QUANT_VARIANTS", raising=False)
    monkeypatch.setenv("QUANT_FORMATS", "int4,fp8,bf16,fp4")
    monkeypatch.setenv("QUANT_JSON", str(tmp_path / "all.json"))
    path = quant.main(quant.SMALL, out=tmp_path / "quant.md")
    text = path.read_text()
    assert "commit" in text and "read ceiling" in text and "FAILED" not in text
    rows = [
        line for line in text.splitlines() if line.startswith("| routed experts") or line.startswith("| kv_a")
    ]
    timed = [r for r in rows if "torch" not in r]
    # int4 x (experts, linear) x (default, other INT4 arithmetic); fp8 (software decode: the CPU
    # default) and bf16 x (experts, linear); fp4 experts only; at T = 4 the int4 and fp8 linears
    # on the GEMV kernel too
    assert len(timed) == 11
    assert sum("pallas:int4-" in r for r in timed) == 2
    assert sum("| pallas:gemv |" in r for r in timed) == 2
    assert all(r.split("|")[5].strip() for r in timed)  # every Pallas / XLA row has a time


def test_nvfp4_rows_match_the_reference(tmp_path, monkeypatch):
    """NVFP4 experts and linears (e4m3 scales per 16, a global scale per matrix) checked against the
    float32 reference and timed, at T = 1 (the experts also on the 4-bit tile variants)."""
    monkeypatch.setenv("QUANT_TOKENS", "1")
    monkeypatch.delenv("QUANT_VARIANTS", raising=False)
    monkeypatch.setenv("QUANT_FORMATS", "nvfp4")
    text = quant.main(quant.SMALL, out=tmp_path / "quant.md").read_text()
    rows = [line for line in text.splitlines() if line.startswith(("| routed experts", "| kv_a"))]
    timed = [r for r in rows if "| nvfp4 |" in r and "torch" not in r]
    assert "FAILED" not in text and any("| routed experts" in r for r in timed)
    assert any("| kv_a" in r for r in timed) and all(r.split("|")[5].strip() for r in timed)


def test_json_parts_merge(tmp_path, monkeypatch):
    monkeypatch.delenv("QUANT_TOKENS", raising=False)
    parts = []
    for fmt in ("fp4", "bf16"):  # the two quickest formats, in the opposite of the file's order
        monkeypatch.setenv("QUANT_FORMATS", fmt)
        monkeypatch.setenv("QUANT_JSON", str(tmp_path / f"{fmt}.json"))
        quant.main(quant.SMALL, out=tmp_path / f"{fmt}.md")
        parts.append(tmp_path / f"{fmt}.json")
    text = quant.merge(tmp_path / "merged.md", parts).read_text()
    lines = [line for line in text.splitlines() if line.startswith("| routed experts")]
    assert [line.split("|")[2].strip() for line in lines][:2] == ["bf16", "bf16"]  # FORMATS order
    assert any("| fp4 |" in line for line in lines) and "## Summary" in text


def test_format_slices_are_cumulative():
    assert quant._deadlines(("int4", "fp8", "bf16"), 100.0, {"int4": 30, "fp8": 20}) == {
        "int4": 30.0,
        "fp8": 50.0,
        "bf16": 100.0,
    }


def test_random_int4_weights_take_the_loaders_layout():
    """Expert stacks in int32 words (K a multiple of 256), linears and ``int4-bytes`` in bytes."""
    shape = lambda fmt, lead: jax.eval_shape(quant.random_weight, jax.random.key(0), fmt, lead, 512, 64)  # noqa: E731
    stack = shape("int4", (2,))
    assert stack.kpack == WORD_KPACK and stack.codes.shape == (2, 64, 64) and stack.codes.dtype == jnp.int32
    assert shape("int4", ()).kpack == 64 and shape(quant.INT4_BYTES, (2,)).kpack == 64


def test_linear_rows_ask_for_the_gemv_kernel(monkeypatch):
    """``pallas:gemv`` next to ``pallas`` at T <= 4 only; ``gemv=1`` / ``gemv=0`` in a QUANT_QMM_TILES
    variant starts it from the table's GEMV / tensor-core config, the other fields applied on top."""
    monkeypatch.delenv(GEMV_ENV, raising=False)
    monkeypatch.setenv("QUANT_QMM_TILES", "g128:gemv=1+block_n=128,tc:gemv=0,w8:num_warps=8")
    impls = {i.name: i for i in quant._impls("int4", "linear", 1)}
    assert impls["pallas:gemv"].gemv is True and not impls["pallas:gemv"].variant
    assert "pallas:gemv" not in {i.name for i in quant._impls("fp8", "linear", 8)}
    monkeypatch.setattr(quant.qmm_kernel, "quant_matmul", lambda x, w, **kw: kw["config"])
    w = jax.eval_shape(quant.random_weight, jax.random.key(0), "int4", (), 512, 256)
    x = jax.ShapeDtypeStruct((1, 512), jnp.bfloat16)
    config = {name: quant._linear_fn(quant.SMALL, "int4", impl)(x, w) for name, impl in impls.items()}
    assert config["pallas"] is None and config["pallas:gemv"].gemv
    assert config["pallas:g128"].gemv and config["pallas:g128"].block_n == 128
    assert not config["pallas:tc"].gemv and not config["pallas:w8"].gemv
    assert config["pallas:w8"].num_warps == 8
