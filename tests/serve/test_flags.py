"""vLLM's and SGLang's flags: the seed deployment commands run with ``python -m serve`` in their
place (honoured, ignored with a warning, or refused by name), and docs/serving.md's table lists
exactly the flags of ``--help``."""

from __future__ import annotations

import pathlib
import re
import shlex

import jax
import pytest

from jaxdsa.serve import cli, foreign_flags
from tests.serve.conftest import ROOT

# The seed commands, as their authors wrote them (models and hosts aside).
A100_VLLM = (
    "--tensor-parallel-size 8 --no-async-scheduling --gpu-memory-utilization 0.90 --max-model-len 32768 "
    "--trust-remote-code --kv-cache-dtype auto --port 8000"
)
ASCEND_VLLM = (
    "--host 0.0.0.0 --port 8077 --data-parallel-size 2 --tensor-parallel-size 8 --enable-expert-parallel "
    "--seed 1024 --served-model-name glm-52 --max-num-seqs 48 --max-model-len 20480 "
    "--max-num-batched-tokens 4096 --trust-remote-code --gpu-memory-utilization 0.95 --quantization ascend "
    "--async-scheduling --additional-config "
    """'{"enable_npugraph_ex": true,"fuse_muls_add":true,"multistream_overlap_shared_expert":true}' """
    """--compilation-config '{"cudagraph_mode": "FULL_DECODE_ONLY"}' """
    """--speculative-config '{"num_speculative_tokens": 3, "method": "deepseek_mtp"}'"""
)
SGLANG_KT = (
    "--host 0.0.0.0 --port 5000 --kt-amx-weight-path /mnt/cpu --kt-cpuinfer 128 --kt-threadpool-count 4 "
    "--kt-num-gpu-experts 0 --kt-amx-method AMXINT8 --attention-backend flashinfer --trust-remote-code "
    "--mem-fraction-static 0.98 --chunked-prefill-size 4096 --max-running-requests 1 --context-length 131072 "
    "--max-total-tokens 131072 --served-model-name DeepSeek-V3-0324 --enable-mixed-chunk "
    "--disable-shared-experts-fusion"
)
V4_SM120_VLLM = (
    "--trust-remote-code --kv-cache-dtype fp8 --block-size 256 --tensor-parallel-size 8 "
    "--pipeline-parallel-size 1 --max-model-len 1024 --gpu-memory-utilization 0.88 "
    "--safetensors-load-strategy prefetch --tokenizer-mode deepseek_v4 --tool-call-parser deepseek_v4 "
    "--enable-auto-tool-choice --reasoning-parser deepseek_v4 --host 0.0.0.0 --port 5001 "
    "--distributed-executor-backend ray --enforce-eager"
)
LOCAL = ["--host", "127.0.0.1", "--port", "0"]


def _with(command: str, **changes: str) -> list[str]:
    """The command's flags with some values replaced (a machine of one CPU device, a tiny model)."""
    argv = shlex.split(command)
    for flag, value in changes.items():
        argv[argv.index("--" + flag.replace("_", "-")) + 1] = value
    return argv


def _start(argv: list[str], capsys) -> tuple[cli.Server, str]:
    server = cli.build(cli.parse_args(argv))
    return server, capsys.readouterr().err


def _refusal(argv: list[str], capsys) -> str:
    with pytest.raises(SystemExit) as e:
        cli.main(argv)
    assert e.value.code == 2
    return capsys.readouterr().err


@pytest.mark.parametrize("command", [A100_VLLM, ASCEND_VLLM, SGLANG_KT, V4_SM120_VLLM])
def test_every_seed_command_parses(command):
    cli.parse_args(["model", *shlex.split(command)])


def test_sglang_names_land_on_the_same_settings():
    args = cli.parse_args(["m", *shlex.split(SGLANG_KT)])
    assert (args.gpu_memory_utilization, args.max_num_batched_tokens) == (0.98, 4096)
    assert (args.max_num_seqs, args.max_model_len) == (1, 131072)
    assert (args.num_gpu_experts, args.cpu_threads) == (0, 128)  # KTransformers' hybrid MoE
    warned = []
    assert foreign_flags.check(args, warned.append) is None
    assert {"--kt-amx-method", "--kt-amx-weight-path", "--kt-threadpool-count"} < {
        w.split(" ignored:")[0] for w in warned
    }
    args = cli.parse_args(["--model-path", "m", "--tp-size", "2", "--dp-size", "2", "--ep-size", "4"])
    assert (args.model_flag, args.tensor_parallel_size, args.data_parallel_size) == ("m", 2, 2)
    assert args.expert_parallel_size == 4


def test_the_a100_command_starts_on_the_tiny_model(glm_dir, capsys):
    """The A100 report's command, at the device count and context this machine and model have."""
    argv = _with(A100_VLLM, tensor_parallel_size="1", max_model_len="256", port="0")
    server, log = _start([glm_dir, *argv, "--no-warmup", "--host", "127.0.0.1"], capsys)
    try:
        assert "--trust-remote-code accepted" in log
        on = [line for line in log.splitlines() if line.startswith("jaxdsa: on: ")]
        assert on[:3] == [  # one line per feature
            "jaxdsa: on: synchronous scheduling",
            "jaxdsa: on: memory budget 0.9 of each GPU",
            "jaxdsa: on: tp 1 ep 1 dp 1",
        ]
        assert server.context.max_model_len == 256
    finally:
        server.engine.shutdown()
    more = 2 * jax.device_count()  # as its -tp 8 on a machine with fewer GPUs
    message = _refusal([glm_dir, *LOCAL, "--tensor-parallel-size", str(more), "--no-warmup"], capsys)
    assert f"needs {more} devices" in message


def test_the_ascend_guides_command_starts_with_mtp_and_warns_for_what_it_ignores(glm_dir, capsys):
    argv = _with(ASCEND_VLLM, data_parallel_size="1", tensor_parallel_size="1", max_model_len="256", port="0")
    server, log = _start([glm_dir, *argv, "--no-warmup", "--host", "127.0.0.1"], capsys)
    try:
        for flag in ("--additional-config", "--compilation-config"):
            assert f"{flag} ignored:" in log
        assert "--quantization ascend taken as auto" in log
        assert "MTP speculative decoding, 3 drafts per step" in log and "async scheduling" in log
        assert server.context.model_names == ["glm-52"]
    finally:
        server.engine.shutdown()


@pytest.mark.parametrize(
    "command, message",
    [
        ("--pipeline-parallel-size 2", "--pipeline-parallel-size: pipeline parallelism is not supported"),
        ("--headless", "--headless: the server runs on one host"),
        ("--data-parallel-address 10.0.0.1", "--data-parallel-address: the server runs on one host"),
        (
            "--nnodes 2 --node-rank 1",
            "--nnodes: the server runs on one host; multi-node serving is not "
            "supported; --node-rank: the server runs on one host",
        ),
        ("--tokenizer other/tok", "--tokenizer other/tok: a tokenizer other than the checkpoint's"),
        ("--tokenizer-m x", "unrecognized arguments: --tokenizer-m"),  # no abbreviations
        ("--kv-transfer-config {}", "--kv-transfer-config: kv_connector None: choose one of NixlConnector"),
        ("--enable-expert-parallel -tp 2 -ep 4", "splits the experts over tp x dp = 2 GPUs"),
        ("--generation-config /no/such/dir", "--generation-config: '/no/such/dir' is not auto, vllm"),
        ("--chat-template nope.jinja", "--chat-template: 'nope.jinja' is neither a file nor a Jinja"),
    ],
)
def test_refused_by_name(glm_dir, capsys, command, message):
    assert message in _refusal([glm_dir, *LOCAL, "--no-warmup", *shlex.split(command)], capsys)


def test_vllms_short_ep_and_single_host_values(glm_dir, capsys):
    args = cli.parse_args([glm_dir, "-tp", "2", "-ep", "--nnodes", "1", "--node-rank", "0"])
    assert cli._check_flags(args) == {"tp": 2, "ep": 2, "dp": 1, "dp_attention": False}
    assert cli._check_flags(cli.parse_args([glm_dir, "-tp", "2", "-ep", "1"]))["ep"] == 1
    assert capsys.readouterr().err == ""  # nothing ignored, nothing to warn about


@pytest.mark.parametrize(
    "kv_cache_dtype, says",
    [
        ("fp8_e5m2", "choose one of auto, bfloat16, float16, float32, fp8, fp8_e4m3, fp8_ds_mla"),
        ("bfloat16", "the cache is kept in the model's dtype (float32) or in fp8"),
    ],
)
def test_a_cache_dtype_jaxdsa_does_not_store_is_refused_by_name(glm_dir, capsys, kv_cache_dtype, says):
    command = _with(V4_SM120_VLLM, tensor_parallel_size="1", host="127.0.0.1", kv_cache_dtype=kv_cache_dtype)
    message = _refusal([glm_dir, *LOCAL, "--no-warmup", *command], capsys)
    assert f"--kv-cache-dtype: kv_cache_dtype {kv_cache_dtype!r}: " in message and says in message


def test_the_server_keeps_an_fp8_cache(glm_dir, capsys):
    command = _with(V4_SM120_VLLM, tensor_parallel_size="1", host="127.0.0.1", port="0", max_model_len="256")
    server, log = _start([glm_dir, "--no-warmup", *command], capsys)
    try:
        assert "(fp8 rows)" in log
    finally:
        server.engine.shutdown()


def test_chat_template_and_generation_config(glm_dir, tmp_path, capsys):
    template = tmp_path / "t.jinja"
    template.write_text("{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}<assistant>")
    argv = [glm_dir, *LOCAL, "--no-warmup", "--chat-template", str(template), "--generation-config", "vllm"]
    server, log = _start(argv, capsys)
    try:
        prompt = server.context.chat_format.render([{"role": "user", "content": "hi"}])
        assert prompt.text == "<user>hi<assistant>"
        assert server.context.default_sampling == {} and "chat template from --chat-template" in log
    finally:
        server.engine.shutdown()


def _table_flags() -> set[str]:
    text = (pathlib.Path(ROOT) / "docs" / "serving.md").read_text(encoding="utf-8")
    section = text.split("## Flags:", 1)[1].split("\n## ", 1)[0]
    rows = [line.split("|")[1] for line in section.splitlines() if line.startswith("| `")]
    flags = set()
    for cell in rows:
        for flag in re.findall(r"`(-{1,2}[\w\[\]-]+)`", cell):
            flags |= {flag.replace("[no-]", ""), flag.replace("[no-]", "no-")} if "[no-]" in flag else {flag}
    return flags


def test_the_docs_table_lists_exactly_the_flags_of_help():
    parser = cli.build_parser()
    flags = {o for a in parser._actions for o in a.option_strings if o not in ("-h", "--help")}
    table = _table_flags()
    assert flags - table == set(), "flags missing from docs/serving.md's table"
    assert table - flags == set(), "flags in docs/serving.md's table that --help does not have"


def test_vllms_modelopt_fp4_is_nvfp4(glm_dir):
    """vLLM names ModelOpt NVFP4 ``modelopt_fp4``: the same assertion as jaxdsa's ``nvfp4``."""
    args = cli.parse_args([glm_dir, "--quantization", "modelopt_fp4"])
    cli._check_flags(args)
    assert args.quantization == "nvfp4"
