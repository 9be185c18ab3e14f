"""Tiny-model tokenizers and chat formats: GLM-5 Jinja template, DeepSeek-V3.2 encoder and template,
DeepSeek-V4 template.

Expected strings are the byte-exact examples of docs/models.md §6.1 / §6.3, or written out by hand from
the rules there. tests/reference/check_make_tiny_hf.py checks the same templates through HF's own
``apply_chat_template``.
"""

from __future__ import annotations

import json

import jinja2
import jinja2.sandbox
import pytest

from jaxdsa.checkpoints import tokenizer_assets as ta
from jaxdsa.serve.chat_format import DeepSeekV4ChatFormat
from jaxdsa.serve.deepseek_encoding import encode_messages, parse_completion
from tests.serve.conftest import TOOLS

MIXED = "Héllo wörld! 你好，世界。こんにちは 안녕 🙂🚀👍🏽 𝔘𝔫𝔦 def f(x):\n\treturn x ** 2  # Ångström ½ €"
WEATHER_CALL = {
    "type": "function",
    "function": {"name": "get_weather", "arguments": {"city": "Paris", "days": 3}},
}


@pytest.fixture(scope="module", params=["glm_moe_dsa", "deepseek_v32"])
def family_tok(request):
    return request.param, ta.build_tokenizer(request.param)


# ---- tokenizers ----------------------------------------------------------------------------


def test_tokenizer_round_trip_and_size(family_tok):
    _, tok = family_tok
    assert tok.get_vocab_size() == ta.VOCAB_SIZE == 512
    ids = tok.encode(MIXED).ids
    assert tok.decode(ids) == MIXED
    assert len(ids) < len(MIXED.encode())  # merges were learned
    assert max(ids) < 512


def test_tokenizer_is_deterministic(family_tok):
    family, tok = family_tok
    assert ta.build_tokenizer(family).to_str() == tok.to_str()


@pytest.mark.parametrize(
    "family, expected",
    [
        ("glm_moe_dsa", {"<|endoftext|>": 492, "[gMASK]": 494, "<sop>": 496, "<|system|>": 498,
                         "<|user|>": 499, "<|assistant|>": 500, "<|observation|>": 501, "<think>": 502,
                         "</think>": 503, "<tool_call>": 504, "</arg_value>": 511}),
        ("deepseek_v32", {"<｜begin▁of▁sentence｜>": 0, "<｜end▁of▁sentence｜>": 1, "<｜User｜>": 507,
                          "<｜Assistant｜>": 508, "<think>": 509, "</think>": 510, "｜DSML｜": 511}),
    ],
)  # fmt: skip
def test_special_tokens_are_single_ids(family, expected):
    tok = ta.build_tokenizer(family)
    spec = ta.family_tokens(family)
    for content in list(spec.leading) + [c for c, _ in spec.added]:
        assert len(tok.encode(content).ids) == 1, content
    assert {c: tok.encode(c).ids[0] for c in expected} == expected
    glued = "".join(expected) + "x"  # special tokens are matched inside running text too
    assert tok.encode(glued).ids[:-1] == list(expected.values())


def test_skip_special_tokens_keeps_parser_markers():
    glm, ds = ta.build_tokenizer("glm_moe_dsa"), ta.build_tokenizer("deepseek_v32")
    text = (
        "<|assistant|><think>r</think>a<tool_call>f<arg_key>k</arg_key><arg_value>v</arg_value></tool_call>"
    )
    assert (
        glm.decode(glm.encode(text).ids)
        == "ra<tool_call>f<arg_key>k</arg_key><arg_value>v</arg_value></tool_call>"
    )
    text = "<｜Assistant｜><think>r</think>a<｜DSML｜invoke><｜end▁of▁sentence｜>"
    assert ds.decode(ds.encode(text).ids) == "<think>r</think>a<｜DSML｜invoke>"


# ---- GLM-5 template ------------------------------------------------------------------------


def glm(messages, **kwargs) -> str:
    return ta.render_chat_template(ta.GLM_CHAT_TEMPLATE, messages, **kwargs)


HISTORY = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Hi"},
    {"role": "assistant", "content": "Hello!", "reasoning_content": "Greet back."},
    {"role": "user", "content": "Again"},
]


def test_glm_models_md_example_thinking_off():
    out = glm(HISTORY, add_generation_prompt=True, enable_thinking=False)
    expected = (
        "[gMASK]<sop><|system|>Be brief.<|user|>Hi<|assistant|></think>Hello!"
        "<|user|>Again<|assistant|></think>"
    )
    assert out == expected


def test_glm_thinking_on_strips_history_keeps_current_turn():
    out = glm(HISTORY, add_generation_prompt=True)
    assert out.endswith("<|assistant|></think>Hello!<|user|>Again<|assistant|><think>")
    kept = glm(HISTORY, add_generation_prompt=True, clear_thinking=False)
    assert "<|assistant|><think>Greet back.</think>Hello!<|user|>" in kept
    current = HISTORY[:2] + [{"role": "assistant", "content": "Hello!", "reasoning_content": " Greet. "}]
    assert glm(current) == "[gMASK]<sop><|system|>Be brief.<|user|>Hi<|assistant|><think>Greet.</think>Hello!"
    inline = HISTORY[:2] + [{"role": "assistant", "content": "<think>Greet.</think>\nHello!"}]
    assert glm(inline) == glm(current)
    parts = [{"role": "user", "content": [{"type": "text", "text": "A"}, {"type": "text", "text": "B"}]}]
    assert glm(parts) == "[gMASK]<sop><|user|>AB"


GLM_TOOLS_SYSTEM = (
    "<|system|>\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
    '{"type": "function", "function": {"name": "get_weather", "description": "Weather for a city", '
    '"parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}\n'
    "</tools>\n\nFor each function call, output the function name and arguments within the following "
    "XML format:\n"
    "<tool_call>{function-name}<arg_key>{arg-key-1}</arg_key><arg_value>{arg-value-1}</arg_value>"
    "<arg_key>{arg-key-2}</arg_key><arg_value>{arg-value-2}</arg_value>...</tool_call>"
)


def test_glm_tools_calls_and_results():
    messages = [
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": "",
            "reasoning_content": "Use the tool.",
            "tool_calls": [WEATHER_CALL],
        },
        {"role": "tool", "content": "sunny"},
        {"role": "tool", "content": "22°C"},
    ]
    out = glm(messages, tools=TOOLS, add_generation_prompt=True)
    assert out == (
        "[gMASK]<sop>" + GLM_TOOLS_SYSTEM + "<|user|>Weather in Paris?"
        "<|assistant|><think>Use the tool.</think>"
        "<tool_call>get_weather<arg_key>city</arg_key><arg_value>Paris</arg_value>"
        "<arg_key>days</arg_key><arg_value>3</arg_value></tool_call>"
        "<|observation|><tool_response>sunny</tool_response><tool_response>22°C</tool_response>"
        "<|assistant|><think>"
    )
    two = {
        "role": "assistant",
        "content": "Both.",
        "tool_calls": [{"name": "a", "arguments": {}}, WEATHER_CALL],
    }
    assert glm([two]) == (
        "[gMASK]<sop><|assistant|></think>Both.<tool_call>a</tool_call><tool_call>get_weather"
        "<arg_key>city</arg_key><arg_value>Paris</arg_value><arg_key>days</arg_key><arg_value>3</arg_value></tool_call>"
    )
    json_args = {"role": "assistant", "tool_calls": [{"function": {"name": "a", "arguments": '{"x": 1}'}}]}
    with pytest.raises(jinja2.TemplateError, match="mapping"):
        glm([json_args])


def test_glm_template_ignores_jinja_whitespace_settings():
    """Same bytes under HF's trim_blocks/lstrip_blocks and under a plain environment."""
    env = jinja2.sandbox.ImmutableSandboxedEnvironment()
    env.filters["tojson"] = ta._tojson
    messages = HISTORY + [
        {"role": "assistant", "tool_calls": [WEATHER_CALL]},
        {"role": "tool", "content": "ok"},
    ]
    plain = env.from_string(ta.GLM_CHAT_TEMPLATE).render(
        messages=messages, tools=TOOLS, add_generation_prompt=True
    )
    assert plain == glm(messages, tools=TOOLS, add_generation_prompt=True)


# ---- DeepSeek-V3.2 encoder and template ----------------------------------------------------

BOS, EOS = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"
TWO_TURNS = [
    {"role": "system", "content": "S"},
    {"role": "user", "content": "U1"},
    {"role": "assistant", "content": "A1", "reasoning_content": "R1"},
    {"role": "user", "content": "U2"},
]


def test_deepseek_models_md_examples():
    head = f"{BOS}S<｜User｜>U1<｜Assistant｜></think>A1{EOS}<｜User｜>U2<｜Assistant｜>"
    assert encode_messages(TWO_TURNS, "thinking") == head + "<think>"
    assert encode_messages(TWO_TURNS, "chat") == head + "</think>"
    assert encode_messages(TWO_TURNS) == head + "</think>"


TOOL_TURNS = [
    {"role": "user", "content": "Weather?"},
    {
        "role": "assistant",
        "content": "Checking.",
        "reasoning_content": "Need data.",
        "tool_calls": [
            {
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Paris", "days": 3}'},
            },
            {"type": "function", "function": {"name": "now", "arguments": "{}"}},
        ],
    },
    {"role": "tool", "content": "sunny"},
    {"role": "tool", "content": "noon"},
]
DSML_CALLS = (
    "\n\n<｜DSML｜function_calls>\n"
    '<｜DSML｜invoke name="get_weather">\n'
    '<｜DSML｜parameter name="city" string="true">Paris</｜DSML｜parameter>\n'
    '<｜DSML｜parameter name="days" string="false">3</｜DSML｜parameter>\n'
    "</｜DSML｜invoke>\n"
    '<｜DSML｜invoke name="now">\n\n</｜DSML｜invoke>\n'
    "</｜DSML｜function_calls>"
)
RESULTS = "\n\n<function_results>\n<result>sunny</result>\n<result>noon</result>\n</function_results>\n\n"


def test_deepseek_tool_calls_and_results():
    assert encode_messages(TOOL_TURNS, "thinking") == (
        f"{BOS}<｜User｜>Weather?<｜Assistant｜><think>Need data.</think>Checking."
        f"{DSML_CALLS}{EOS}{RESULTS}<think>"
    )
    assert encode_messages(TOOL_TURNS, "chat") == (
        f"{BOS}<｜User｜>Weather?<｜Assistant｜></think>Checking.{DSML_CALLS}{EOS}{RESULTS}</think>"
    )


def test_deepseek_tools_in_system_prompt():
    out = encode_messages([{"role": "user", "content": "Hi"}], tools=TOOLS)
    assert out.startswith(f"{BOS}\n\n## Tools\nYou have access to a set of tools")
    schema = '{"name": "get_weather", "description": "Weather for a city", "parameters": {"type": "object", '
    assert f"<functions>\n{schema}" in out
    assert out.endswith('{"city": {"type": "string"}}}}\n</functions>\n<｜User｜>Hi<｜Assistant｜></think>')
    with_system = encode_messages(
        [{"role": "system", "content": "S"}, {"role": "user", "content": "Hi"}], tools=TOOLS
    )
    assert with_system == out.replace(BOS, BOS + "S", 1)


def test_deepseek_developer_and_errors():
    dev = encode_messages([{"role": "developer", "content": "Do X"}], "thinking")
    assert dev == f"{BOS}<｜User｜>\n\n# The user's message is: Do X<｜Assistant｜><think>"
    with pytest.raises(ValueError, match="reasoning_content"):
        encode_messages([{"role": "user", "content": "U"}, {"role": "assistant", "content": "A"}], "thinking")
    with pytest.raises(ValueError, match="tool result"):
        encode_messages([{"role": "user", "content": "U"}, {"role": "tool", "content": "r"}])
    with pytest.raises(ValueError, match="thinking_mode"):
        encode_messages(TWO_TURNS, "fast")


def test_deepseek_parse_completion():
    p = parse_completion(f"Think hard.</think>The answer.{EOS}", "thinking")
    assert (p.reasoning_content, p.content, p.tool_calls) == ("Think hard.", "The answer.", [])
    p = parse_completion("The answer.", "chat")  # no EOS: the server may have stripped it
    assert (p.reasoning_content, p.content, p.tool_calls) == (None, "The answer.", [])
    p = parse_completion("cut off mid-thou", "thinking")
    assert (p.reasoning_content, p.content) == ("cut off mid-thou", "")
    p = parse_completion(f"Checking.{DSML_CALLS}{EOS}", "chat")
    assert p.content == "Checking."
    assert p.tool_calls == [
        {
            "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Paris", "days": 3}'},
        },
        {"type": "function", "function": {"name": "now", "arguments": "{}"}},
    ]


def test_deepseek_tool_call_round_trip():
    """What the encoder writes for an assistant turn parses back to the same call."""
    args = {"q": "naïve 🙂", "n": 2, "flags": [True, None], "opt": {"a": 1.5}, "s": "3"}
    call = {"type": "function", "function": {"name": "search", "arguments": args}}
    user = {"role": "user", "content": "U"}
    reply = {"role": "assistant", "reasoning_content": "R", "content": "", "tool_calls": [call]}
    prompt, full = encode_messages([user], "thinking"), encode_messages([user, reply], "thinking")
    parsed = parse_completion(full[len(prompt) :], "thinking")
    assert parsed.reasoning_content == "R" and parsed.content == ""
    assert [c["function"]["name"] for c in parsed.tool_calls] == ["search"]
    assert json.loads(parsed.tool_calls[0]["function"]["arguments"]) == args


CONVERSATIONS = [
    TWO_TURNS,
    [{"role": "user", "content": "Only a question 🙂"}],
    [{"role": "system", "content": "S"}, {"role": "developer", "content": "D"}],
    [{"role": "user", "content": "U"}, {"role": "assistant", "content": "A", "reasoning_content": "R"}],
    TWO_TURNS
    + [{"role": "assistant", "content": "A2", "reasoning_content": "R2"}, {"role": "user", "content": "U3"}],
]


@pytest.mark.parametrize("mode", ["chat", "thinking"])
@pytest.mark.parametrize("messages", CONVERSATIONS)
def test_deepseek_template_matches_encoder(messages, mode):
    out = ta.render_chat_template(
        ta.DEEPSEEK_CHAT_TEMPLATE, messages, add_generation_prompt=True, thinking_mode=mode
    )
    assert out == encode_messages(messages, mode)


def test_deepseek_template_refuses_tools():
    with pytest.raises(jinja2.TemplateError, match="deepseek_encoding"):
        ta.render_chat_template(ta.DEEPSEEK_CHAT_TEMPLATE, TWO_TURNS, tools=TOOLS)


# ---- DeepSeek-V4 template (tool-less conversations; the server uses jaxdsa.serve.deepseek_v4_encoding) ----

V4_CONVERSATIONS = CONVERSATIONS + [
    [
        {"role": "system", "content": "S"},
        {"role": "user", "content": "U1"},
        {"role": "user", "content": "U2"},
    ],
    [
        {"role": "developer", "content": "D"},
        {"role": "user", "content": "U"},
        {"role": "assistant", "content": "A"},
    ],
]
V4_KWARGS = [
    {},
    {"enable_thinking": False},
    {"thinking": True},
    {"thinking_mode": "chat"},
    {"reasoning_effort": "max"},
    {"reasoning_effort": "none"},
    {"drop_thinking": False},
]


@pytest.mark.parametrize("kwargs", V4_KWARGS)
@pytest.mark.parametrize("messages", V4_CONVERSATIONS)
def test_deepseek_v4_template_matches_the_server_encoding(messages, kwargs):
    out = ta.render_chat_template(
        ta.DEEPSEEK_V4_CHAT_TEMPLATE, messages, add_generation_prompt=True, **kwargs
    )
    assert out == DeepSeekV4ChatFormat().render(messages, kwargs=kwargs).text


def test_deepseek_v4_template_refuses_tools():
    with pytest.raises(jinja2.TemplateError, match="deepseek_v4_encoding"):
        ta.render_chat_template(ta.DEEPSEEK_V4_CHAT_TEMPLATE, TWO_TURNS, tools=TOOLS)
    assert ta.family_tokens("deepseek_v4") == ta.family_tokens("deepseek_v32")
