"""``python -m serve``: bad input exits 2 with one clear line; the README line serves the default model."""

from __future__ import annotations

import json
import os
import pathlib
import shlex
import shutil
import signal
import subprocess
import sys

import jax
import openai
import pytest
from openai.types.chat import ChatCompletion

from jaxdsa.engine.engine import enable_compilation_cache
from jaxdsa.serve import cli
from tests.serve.conftest import ROOT, wait_ready

LOCAL = ["--host", "127.0.0.1", "--port", "0"]


def exit_message(argv: list[str], capsys) -> str:
    with pytest.raises(SystemExit) as e:
        cli.main(argv)
    assert e.value.code == 2
    return capsys.readouterr().err


def test_missing_model_dir(capsys, tmp_path):
    assert "neither a directory nor in the Hugging Face cache" in exit_message(
        [str(tmp_path / "nope"), *LOCAL], capsys
    )


def test_checkpoint_without_tokenizer(capsys):
    assert "no tokenizer.json" in exit_message(
        [os.path.join(ROOT, "tests", "fixtures", "glm5"), *LOCAL], capsys
    )


def test_directory_without_config(capsys, tmp_path):
    assert "config.json" in exit_message([str(tmp_path), *LOCAL], capsys)


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--tensor-parallel-size", "4", "--expert-parallel-size", "3"], "ep (3) must divide tp (4)"),
        (["--data-parallel-size", "0"], "dp must be >= 1"),
        (
            ["--data-parallel-size", "4", "--expert-parallel-size", "2", "--enable-dp-attention"],
            "must be a multiple of dp",
        ),
        (["--enable-auto-tool-choice"], "--enable-auto-tool-choice needs --tool-call-parser"),
        (["--max-num-seqs", "0"], "--max-num-seqs must be >= 1"),
        (["--tool-call-parser", "hermes"], "invalid choice: 'hermes'"),
        (["--no-such-flag"], "unrecognized arguments"),
        (["--speculative-config", '{"method": "eagle", "num_speculative_tokens": 2}'], "method 'eagle'"),
        (["--speculative-config", "{"], "--speculative-config: speculative config is not JSON"),
        (["--gpu-memory-utilization", "1.5"], "--gpu-memory-utilization: gpu_memory_utilization must be in"),
    ],
)
def test_bad_flags(glm_dir, capsys, flags, message):
    assert message in exit_message([glm_dir, *LOCAL, *flags], capsys)


def test_more_parallelism_than_devices(glm_dir, capsys):
    """The vLLM line's --tensor-parallel-size 8 on a machine without 8 devices: a clear exit 2."""
    n = jax.device_count()
    message = exit_message([glm_dir, *LOCAL, "--no-warmup", "--tensor-parallel-size", str(2 * n)], capsys)
    assert f"needs {2 * n} devices, found {n}" in message


def test_a_model_that_does_not_fit_the_budget_exits_before_loading(glm_dir, capsys, monkeypatch):
    """What a GPU with too little memory reports: one line with the numbers, exit 2."""
    from jaxdsa.engine import memory

    small = memory.DeviceMemory(total=1 << 20, budget=0.9 * (1 << 20), in_use=0)
    monkeypatch.setattr(memory, "device_memory", lambda utilization: small)
    message = exit_message([glm_dir, *LOCAL, "--no-warmup", "--max-model-len", "256"], capsys)
    assert "does not fit: per device, weights" in message and "Raise --gpu-memory-utilization" in message


def test_max_model_len_beyond_the_model(glm_dir, capsys):
    assert "max_position_embeddings" in exit_message(
        [glm_dir, *LOCAL, "--max-model-len", "4096", "--no-warmup"], capsys
    )


def test_busy_port(glm_dir, capsys):
    sock = cli.bind("127.0.0.1", 0)
    sock.listen()
    port = str(sock.getsockname()[1])
    try:
        assert "cannot listen on 127.0.0.1:" in exit_message(
            [glm_dir, "--host", "127.0.0.1", "--port", port], capsys
        )
    finally:
        sock.close()


def test_hub_ids_resolve_through_the_hf_cache(glm_dir, tmp_path, monkeypatch):
    repo = tmp_path / "hub" / "models--zai-org--GLM-5"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text("abc123\n")
    shutil.copytree(glm_dir, repo / "snapshots" / "abc123")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    assert cli.resolve_model_dir("zai-org/GLM-5") == str(repo / "snapshots" / "abc123")
    with pytest.raises(cli.StartupError, match="does not download"):
        cli.resolve_model_dir("zai-org/GLM-5.1")


def readme_quick_start() -> tuple[list[str], str, dict]:
    """From the README's Quick start: the flags of its server line (after ``python -m serve``), and
    the path and JSON body of the curl request below it."""
    text = (pathlib.Path(ROOT) / "README.md").read_text(encoding="utf-8")
    start = text.index("## Quick start")
    section = text[start : text.index("\n## ", start)]
    (line,) = [x for x in section.splitlines() if x.startswith("python3.12 -m venv") and " -m serve" in x]
    curl = section[section.index("curl ") :]
    argv = shlex.split(curl[: curl.index("```")])
    url, body = argv[1], json.loads(argv[argv.index("-d") + 1])
    assert argv[argv.index("-H") + 1] == "Content-Type: application/json"
    return shlex.split(line.split(" -m serve", 1)[1]), url[url.index("/v1/") :], body


def check_chat_completion(body: dict, tools: list[dict]) -> None:
    """An OpenAI chat completion: a tool call of a named tool with JSON arguments, or text."""
    ChatCompletion.model_validate(body)
    (choice,) = body["choices"]
    message = choice["message"]
    assert body["object"] == "chat.completion" and message["role"] == "assistant"
    if message.get("tool_calls"):
        assert choice["finish_reason"] == "tool_calls"
        names = {t["function"]["name"] for t in tools}
        for call in message["tool_calls"]:
            assert call["type"] == "function" and call["id"] and call["function"]["name"] in names
            assert isinstance(json.loads(call["function"]["arguments"]), dict)
    else:  # no call parsed: the reply is the text
        assert isinstance(message["content"], str) and choice["finish_reason"] in ("stop", "length")


def test_readme_line_serves_the_default_model(tmp_path):
    """The Quick start's server line with no model: writes the tiny GLM-5 into JAXDSA_CACHE_DIR, warms
    up, serves; the README's tool-call request, whose prompt the old 256-token model refused, gets a
    well-formed reply."""
    enable_compilation_cache()  # share compilations with this process's next runs of this test
    env = dict(os.environ, JAXDSA_CACHE_DIR=str(tmp_path), JAX_PLATFORMS="cpu", PYTHONUNBUFFERED="1")
    if jax.config.jax_compilation_cache_dir:
        env |= {
            "JAX_COMPILATION_CACHE_DIR": jax.config.jax_compilation_cache_dir,
            "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
        }
    flags, path, request = readme_quick_start()
    assert "--enable-auto-tool-choice" in flags and request["tools"]
    argv = [sys.executable, "-m", "serve", *flags, "--host", "127.0.0.1", "--port", "0"]
    with (
        open(tmp_path / "serve.log", "w+") as log,
        subprocess.Popen(argv, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT) as proc,
    ):
        try:
            url = wait_ready(proc, tmp_path / "serve.log")
            client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
            models = client.models.list().data
            assert [(m.id, m.max_model_len) for m in models] == [("jaxdsa-tiny-glm5", 4096)]
            r = client.chat.completions.create(
                model="jaxdsa-tiny-glm5", messages=[{"role": "user", "content": "Hi"}], max_tokens=4
            )
            assert r.usage.completion_tokens >= 1
            assert path == "/v1/chat/completions"  # the README's curl, sent by the official client
            reply = client.chat.completions.create(**request).model_dump(exclude_none=True)
            check_chat_completion(reply, request["tools"])
            assert reply["usage"]["prompt_tokens"] > 256
        finally:
            proc.send_signal(signal.SIGINT)
            code = proc.wait(timeout=60)
    output = (tmp_path / "serve.log").read_text()
    assert code == 0, output
    assert os.path.isfile(tmp_path / "default-model" / "model.safetensors")
    assert "compiling step shapes: 18/18" in output and "ready: serving 'jaxdsa-tiny-glm5'" in output, output
