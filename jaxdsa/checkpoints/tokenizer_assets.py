"""Real byte-level BPE tokenizers and chat templates for the tiny random models (``make_tiny``).

The released GLM-5 / DeepSeek-V3.2 tokenizers have ~150k entries, far too many rows for a
64-wide test model, yet serving tests need real tokenizer behaviour: characters split across
byte tokens (streaming detokenization), special tokens that encode to one id, stop ids, and the
family's chat format. So each family gets a byte-level BPE trained deterministically on the small
corpus below plus the family's special tokens, in exactly ``VOCAB_SIZE`` ids.

Special-token ids (``VOCAB_SIZE`` = 512):

* GLM: 492 regular tokens, then ``<|endoftext|>`` 492 (eos/pad), ``[MASK]`` 493, ``[gMASK]`` 494,
  ``[sMASK]`` 495, ``<sop>`` 496, ``<eop>`` 497, ``<|system|>`` 498, ``<|user|>`` 499,
  ``<|assistant|>`` 500, ``<|observation|>`` 501, ``<think>`` 502, ``</think>`` 503, then the tool
  tags 504-511. Generation stops on 492, 499, 501 (docs/models.md §6.1).
* DeepSeek-V3.2: BOS 0 and EOS 1 (the real ids, which the ``dsv32`` preset's config also names),
  505 regular tokens, then ``<｜User｜>`` 507, ``<｜Assistant｜>`` 508, ``<think>`` 509,
  ``</think>`` 510, ``｜DSML｜`` 511. DeepSeek-V4 (same tokenizer family, docs/models.md §6.4) gets the
  same tokenizer with its own chat template.

"Special" (dropped by ``skip_special_tokens``) follows docs/models.md §6: GLM marks the control tokens
and ``<think>``/``</think>`` special and keeps the tool-call tags as plain added tokens; DeepSeek marks
BOS/EOS and the role tokens special and keeps ``<think>``, ``</think>`` and the DSML marker visible so
reasoning and tool-call parsers can work on decoded text.

The chat templates are written so that every tag trims whitespace and all literal text sits inside
expressions: they render the same bytes with or without Hugging Face's ``trim_blocks`` /
``lstrip_blocks`` settings. They rely on HF's ``tojson`` (with ``ensure_ascii``) and
``raise_exception``, which :func:`render_chat_template` provides outside transformers.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Mapping, Sequence
from typing import Any

import jinja2
import jinja2.ext
import jinja2.sandbox
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

VOCAB_SIZE = 512

# Varied text so that the learned merges cover English words, accented Latin, CJK, emoji and code.
CORPUS = """\
The quick brown fox jumps over the lazy dog. A small model can still tell a good story.
Hello! How are you today? I am fine, thank you. What would you like to talk about?
The weather in Paris is mild in spring, with light rain in the morning and sun in the afternoon.
Please write a short summary of the meeting notes and send them to the team before Friday.
In 1969, two astronauts walked on the Moon while a third one stayed in orbit around it.
Numbers: 0 1 2 3 4 5 6 7 8 9 10 42 100 256 1024 3.14159 2.71828 -7 +12 50% $19.99
The user asked the assistant a question, and the assistant answered with a clear explanation.
Let me think about this step by step. First, we read the input. Then we check every value.
Finally, we return the result. If something goes wrong, we raise an error with a useful message.
Tools can be called with arguments: the city is Paris, the unit is celsius, the date is today.
The model reads tokens, attends to earlier positions, and predicts the next token in the sequence.
Sparse attention selects the most relevant keys; experts in a mixture are chosen by a router.
Café, naïve, façade, résumé, déjà vu, crème brûlée, piñata, jalapeño, Ångström, São Paulo.
Élève, hôtel, forêt, garçon, Noël, où est la bibliothèque? Je voudrais un café, s'il vous plaît.
Größe, Straße, Fußgänger, schön, über, Mädchen, Äpfel und Öl. Wie geht es Ihnen heute?
¿Dónde está la estación? Mañana vamos a la playa. El niño comió una manzana.
Ação, coração, informação, não, irmã, pão. Tiếng Việt có nhiều dấu: ă â đ ê ô ơ ư.
Привет, как дела? Сегодня хорошая погода. Γειά σου κόσμε, καλημέρα.
你好，世界！今天天气很好。我们一起去公园散步吧。中文分词是一个有趣的问题。
模型、数据、训练、推理、注意力、专家、路由、缓存。你好你好，世界世界。
こんにちは、世界。今日はいい天気ですね。日本語のテキストも少し入れます。
안녕하세요, 세계. 오늘 날씨가 좋네요. 한국어 문장도 조금 있습니다.
Emoji: 😀 😃 😄 😁 😂 🙂 🚀 🌍 🌟 🔥 ✨ 👍 👋 🎉 ❤️ 🤖 🧠 📚 ✅ ❌ 🙂🙂 🚀🚀
def add(a: int, b: int) -> int:
    \"\"\"Return the sum of a and b.\"\"\"
    return a + b


class Counter:
    def __init__(self) -> None:
        self.count = 0

    def step(self, n: int = 1) -> int:
        self.count += n
        return self.count


for i in range(10):
    if i % 2 == 0:
        print(f"even {i}")
    else:
        print(f"odd {i}")
{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius", "days": 3}}
{"type": "function", "function": {"name": "search", "parameters": {"type": "object"}}}
const values = [1, 2, 3].map((x) => x * 2); // double every value
SELECT name, count(*) FROM users WHERE active = true GROUP BY name ORDER BY name;
x = [a + b for a, b in zip(xs, ys)]  # pairwise sums
if (err != nil) { return fmt.Errorf("read %s: %w", path, err) }
The answer is yes. The answer is no. The answer depends on the question.
We should test the tokenizer on text that it has never seen before, including rare words.
Good morning, good evening, good night. See you tomorrow, and have a nice day!
"""


@dataclasses.dataclass(frozen=True)
class FamilyTokens:
    """Where a family's special tokens go and which ones the tokenizer config names."""

    leading: tuple[str, ...]  # trained in first, ids 0..n-1
    added: tuple[tuple[str, bool], ...]  # (content, special), appended after the BPE vocabulary
    bos: str | None
    eos: str
    stop: tuple[str, ...]  # generation_config eos_token_id list


GLM_TOKENS = FamilyTokens(
    leading=(),
    added=(
        ("<|endoftext|>", True),
        ("[MASK]", True),
        ("[gMASK]", True),
        ("[sMASK]", True),
        ("<sop>", True),
        ("<eop>", True),
        ("<|system|>", True),
        ("<|user|>", True),
        ("<|assistant|>", True),
        ("<|observation|>", True),
        ("<think>", True),
        ("</think>", True),
        ("<tool_call>", False),
        ("</tool_call>", False),
        ("<tool_response>", False),
        ("</tool_response>", False),
        ("<arg_key>", False),
        ("</arg_key>", False),
        ("<arg_value>", False),
        ("</arg_value>", False),
    ),
    bos=None,
    eos="<|endoftext|>",
    stop=("<|endoftext|>", "<|user|>", "<|observation|>"),
)

DEEPSEEK_TOKENS = FamilyTokens(
    leading=("<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"),
    added=(
        ("<｜User｜>", True),
        ("<｜Assistant｜>", True),
        ("<think>", False),
        ("</think>", False),
        ("｜DSML｜", False),
    ),
    bos="<｜begin▁of▁sentence｜>",
    eos="<｜end▁of▁sentence｜>",
    stop=("<｜end▁of▁sentence｜>",),
)

# GLM-5 / 5.1 format (docs/models.md §6.1). Messages read `content` (string or text parts),
# `reasoning_content`, `tool_calls` (arguments must be a mapping, as in HF); kwargs:
# `enable_thinking` (default true), `clear_thinking` (default true: drop reasoning before the last
# user turn, rendering `<|assistant|></think>`).
GLM_CHAT_TEMPLATE = r"""
{%- macro text_of(content) -%}
  {%- if content is string -%}{{- content -}}
  {%- elif content is iterable and content is not mapping -%}
    {%- for part in content -%}
      {%- if part is string -%}{{- part -}}
      {%- elif part is mapping and part.type == 'text' -%}{{- part.text -}}
      {%- endif -%}
    {%- endfor -%}
  {%- elif content is not none -%}{{- content -}}
  {%- endif -%}
{%- endmacro -%}
{{- '[gMASK]<sop>' -}}
{%- if tools -%}
  {{- '<|system|>\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\n' -}}
  {{- 'You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n' -}}
  {%- for tool in tools -%}{{- tool | tojson(ensure_ascii=False) -}}{{- '\n' -}}{%- endfor -%}
  {{- '</tools>\n\nFor each function call, output the function name and arguments within the following XML format:\n' -}}
  {{- '<tool_call>{function-name}<arg_key>{arg-key-1}</arg_key><arg_value>{arg-value-1}</arg_value>' -}}
  {{- '<arg_key>{arg-key-2}</arg_key><arg_value>{arg-value-2}</arg_value>...</tool_call>' -}}
{%- endif -%}
{%- set ns = namespace(last_user=-1) -%}
{%- for m in messages -%}
  {%- if m.role == 'user' -%}{%- set ns.last_user = loop.index0 -%}{%- endif -%}
{%- endfor -%}
{%- for m in messages -%}
  {%- if m.role == 'system' -%}
    {{- '<|system|>' + text_of(m.content) -}}
  {%- elif m.role == 'user' -%}
    {{- '<|user|>' + text_of(m.content) -}}
  {%- elif m.role == 'assistant' -%}
    {%- set content = text_of(m.content) -%}
    {%- set reasoning = m.reasoning_content if m.reasoning_content is string else '' -%}
    {%- if not reasoning and '</think>' in content -%}
      {%- set reasoning = content.split('</think>')[0].split('<think>')[-1] -%}
      {%- set content = content.split('</think>')[-1] -%}
    {%- endif -%}
    {%- set keep = loop.index0 > ns.last_user or (clear_thinking is defined and not clear_thinking) -%}
    {%- if keep and reasoning.strip() -%}
      {{- '<|assistant|><think>' + reasoning.strip() + '</think>' -}}
    {%- else -%}
      {{- '<|assistant|></think>' -}}
    {%- endif -%}
    {{- content.strip() -}}
    {%- for call in m.tool_calls or [] -%}
      {%- set f = call.function if call.function is defined else call -%}
      {%- if f.arguments is not mapping -%}
        {{- raise_exception('tool_call arguments must be a mapping (decode the OpenAI JSON string first)') -}}
      {%- endif -%}
      {{- '<tool_call>' + f.name -}}
      {%- for key, value in f.arguments.items() -%}
        {{- '<arg_key>' + key + '</arg_key><arg_value>' -}}
        {{- value if value is string else value | tojson(ensure_ascii=False) -}}
        {{- '</arg_value>' -}}
      {%- endfor -%}
      {{- '</tool_call>' -}}
    {%- endfor -%}
  {%- elif m.role == 'tool' -%}
    {%- if loop.first or messages[loop.index0 - 1].role != 'tool' -%}{{- '<|observation|>' -}}{%- endif -%}
    {{- '<tool_response>' + text_of(m.content) + '</tool_response>' -}}
  {%- else -%}
    {{- raise_exception('unknown role ' + m.role) -}}
  {%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}
  {{- '<|assistant|></think>' if (enable_thinking is defined and not enable_thinking) else '<|assistant|><think>' -}}
{%- endif -%}
"""  # noqa: E501 (jinja template written verbatim into tokenizer_config.json)

# DeepSeek-V3.2 ships a Python encoder, not a template (jaxdsa/serve/deepseek_encoding.py is ours); this
# template renders the same string for conversations without tools. kwarg: `thinking_mode`
# ('chat' default, or 'thinking'). The assistant opener belongs to the user turn in this format, so
# `add_generation_prompt` has no effect.
DEEPSEEK_CHAT_TEMPLATE = r"""
{%- if tools -%}
  {{- raise_exception('DeepSeek-V3.2 tool prompts are rendered by jaxdsa.serve.deepseek_encoding, not this template') -}}
{%- endif -%}
{%- set thinking = thinking_mode is defined and thinking_mode == 'thinking' -%}
{%- set ns = namespace(last_user=-1) -%}
{%- for m in messages -%}
  {%- if m.role in ['user', 'developer'] -%}{%- set ns.last_user = loop.index0 -%}{%- endif -%}
{%- endfor -%}
{{- '<｜begin▁of▁sentence｜>' -}}
{%- for m in messages -%}
  {%- if m.role == 'system' -%}
    {{- m.content or '' -}}
  {%- elif m.role in ['user', 'developer'] -%}
    {{- '<｜User｜>' -}}
    {{- m.content if m.role == 'user' else "\n\n# The user's message is: " + m.content -}}
    {{- '<｜Assistant｜>' + ('<think>' if thinking and loop.index0 == ns.last_user else '</think>') -}}
  {%- elif m.role == 'assistant' -%}
    {%- if m.tool_calls -%}
      {{- raise_exception('DeepSeek-V3.2 tool calls are rendered by jaxdsa.serve.deepseek_encoding, not this template') -}}
    {%- endif -%}
    {%- if thinking and loop.index0 > ns.last_user -%}
      {%- if not m.reasoning_content -%}
        {{- raise_exception('thinking mode: an assistant turn after the last user turn needs reasoning_content') -}}
      {%- endif -%}
      {{- m.reasoning_content + '</think>' -}}
    {%- endif -%}
    {{- (m.content or '') + '<｜end▁of▁sentence｜>' -}}
  {%- else -%}
    {{- raise_exception('role ' + m.role + ' needs jaxdsa.serve.deepseek_encoding') -}}
  {%- endif -%}
{%- endfor -%}
"""  # noqa: E501 (jinja template written verbatim into tokenizer_config.json)

# DeepSeek-V4 also ships only a Python encoder (jaxdsa/serve/deepseek_v4_encoding.py is ours); this template
# renders the same string for conversations without tools, with the server's options
# (jaxdsa.serve.chat_format.DeepSeekV4ChatFormat): thinking on unless `thinking` / `enable_thinking` is
# given and false, `thinking_mode` overriding both; `reasoning_effort` 'max' (effort prefix) or
# 'none' (thinking off); `drop_thinking` (default true). Consecutive user turns merge, and in
# thinking mode developer turns before the last user turn are dropped, as the encoder does.
DEEPSEEK_V4_CHAT_TEMPLATE = r"""
{%- if tools -%}
  {{- raise_exception('DeepSeek-V4 tool prompts are rendered by jaxdsa.serve.deepseek_v4_encoding, not this template') -}}
{%- endif -%}
{%- set ns = namespace(thinking=true, turns=[], last_user=-1, kept=[]) -%}
{%- if thinking_mode is defined -%}
  {%- if thinking_mode not in ['chat', 'thinking'] -%}
    {{- raise_exception('thinking_mode must be chat or thinking') -}}
  {%- endif -%}
  {%- set ns.thinking = thinking_mode == 'thinking' -%}
{%- elif thinking is defined or enable_thinking is defined -%}
  {%- set ns.thinking = (thinking is defined and thinking) or (enable_thinking is defined and enable_thinking) -%}
{%- endif -%}
{%- set effort = reasoning_effort if reasoning_effort is defined else none -%}
{%- if effort == 'none' -%}{%- set ns.thinking = false -%}{%- endif -%}
{%- set drop = drop_thinking if drop_thinking is defined else true -%}
{%- for m in messages -%}
  {%- if m.role not in ['system', 'user', 'developer', 'assistant'] -%}
    {{- raise_exception('role ' + m.role + ' needs jaxdsa.serve.deepseek_v4_encoding') -}}
  {%- endif -%}
  {%- if m.tool_calls -%}
    {{- raise_exception('DeepSeek-V4 tool calls are rendered by jaxdsa.serve.deepseek_v4_encoding, not this template') -}}
  {%- endif -%}
  {%- if m.role == 'user' and ns.turns and ns.turns[-1].role == 'user' -%}
    {%- set merged = {'role': 'user', 'content': ns.turns[-1].content + '\n\n' + (m.content or '')} -%}
    {%- set ns.turns = ns.turns[:-1] + [merged] -%}
  {%- else -%}
    {%- set reasoning = m.reasoning_content or m.reasoning or '' -%}
    {%- set ns.turns = ns.turns + [{'role': m.role, 'content': m.content or '', 'reasoning': reasoning}] -%}
  {%- endif -%}
{%- endfor -%}
{%- for t in ns.turns -%}
  {%- if t.role in ['user', 'developer'] -%}{%- set ns.last_user = loop.index0 -%}{%- endif -%}
{%- endfor -%}
{%- for t in ns.turns -%}
  {%- if not (ns.thinking and drop and t.role == 'developer' and loop.index0 < ns.last_user) -%}
    {%- set ns.kept = ns.kept + [t] -%}
  {%- endif -%}
{%- endfor -%}
{%- set ns.last_user = -1 -%}
{%- for t in ns.kept -%}
  {%- if t.role in ['user', 'developer'] -%}{%- set ns.last_user = loop.index0 -%}{%- endif -%}
{%- endfor -%}
{{- '<｜begin▁of▁sentence｜>' -}}
{%- if ns.kept and ns.thinking and effort == 'max' -%}
  {{- 'Reasoning Effort: Absolute maximum with no shortcuts permitted.\nYou MUST be very thorough in your thinking and comprehensively decompose the problem to resolve the root cause, rigorously stress-testing your logic against all potential paths, edge cases, and adversarial scenarios.\nExplicitly write out your entire deliberation process, documenting every intermediate step, considered alternative, and rejected hypothesis to ensure absolutely no assumption is left unchecked.\n\n' -}}
{%- endif -%}
{%- for t in ns.kept -%}
  {%- if t.role == 'system' -%}
    {{- t.content -}}
  {%- elif t.role in ['user', 'developer'] -%}
    {%- if t.role == 'developer' and not t.content -%}
      {{- raise_exception('a developer message needs content') -}}
    {%- endif -%}
    {{- '<｜User｜>' + t.content -}}
    {%- if loop.last or ns.kept[loop.index0 + 1].role == 'assistant' -%}
      {%- set open = ns.thinking and (not drop or loop.index0 >= ns.last_user) -%}
      {{- '<｜Assistant｜>' + ('<think>' if open else '</think>') -}}
    {%- endif -%}
  {%- else -%}
    {%- if ns.thinking and (not drop or loop.index0 > ns.last_user) -%}
      {{- t.reasoning + '</think>' -}}
    {%- endif -%}
    {{- t.content + '<｜end▁of▁sentence｜>' -}}
  {%- endif -%}
{%- endfor -%}
"""  # noqa: E501 (jinja template written verbatim into tokenizer_config.json)

_FAMILIES: dict[str, tuple[FamilyTokens, str]] = {
    "glm_moe_dsa": (GLM_TOKENS, GLM_CHAT_TEMPLATE),
    "deepseek_v32": (DEEPSEEK_TOKENS, DEEPSEEK_CHAT_TEMPLATE),
    "deepseek_v4": (DEEPSEEK_TOKENS, DEEPSEEK_V4_CHAT_TEMPLATE),  # V3.2's tokens, V4's format
    "glm5_next": (GLM_TOKENS, GLM_CHAT_TEMPLATE),  # GLM-5.3-Flash keeps GLM-5's (docs/models.md §6.1)
}


@dataclasses.dataclass(frozen=True)
class TokenIds:
    """The ids config.json / generation_config.json need."""

    vocab_size: int
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    pad_token_id: int


def _family(family: str) -> tuple[FamilyTokens, str]:
    if family not in _FAMILIES:
        raise ValueError(f"unknown model family {family!r}; choose from {sorted(_FAMILIES)}")
    return _FAMILIES[family]


def family_tokens(family: str) -> FamilyTokens:
    return _family(family)[0]


def chat_template(family: str) -> str:
    return _family(family)[1]


def build_tokenizer(family: str) -> Tokenizer:
    """Train the family's byte-level BPE (deterministic: same corpus, same merges) to VOCAB_SIZE ids."""
    spec = family_tokens(family)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE - len(spec.added),
        min_frequency=2,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=[AddedToken(t, special=True, normalized=False) for t in spec.leading],
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS.splitlines(keepends=True), trainer)
    if tok.get_vocab_size() != VOCAB_SIZE - len(spec.added):
        raise RuntimeError(f"corpus too small: BPE stopped at {tok.get_vocab_size()} tokens")
    for content, special in spec.added:  # one at a time so ids follow the listed order
        tok.add_tokens([AddedToken(content, special=special, normalized=False)])
    assert tok.get_vocab_size(with_added_tokens=True) == VOCAB_SIZE
    return tok


def token_ids(family: str, tok: Tokenizer) -> TokenIds:
    spec = family_tokens(family)
    return TokenIds(
        vocab_size=tok.get_vocab_size(with_added_tokens=True),
        bos_token_id=tok.token_to_id(spec.bos) if spec.bos else None,
        eos_token_ids=tuple(tok.token_to_id(t) for t in spec.stop),
        pad_token_id=tok.token_to_id(spec.eos),
    )


def tokenizer_config(family: str, model_max_length: int) -> dict[str, Any]:
    """``tokenizer_config.json``: a fast tokenizer that adds no BOS/EOS itself (the chat format does)."""
    spec = family_tokens(family)
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": spec.bos,
        "eos_token": spec.eos,
        "pad_token": spec.eos,
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": model_max_length,
        "padding_side": "left",
        "chat_template": chat_template(family),
    }


def write_tokenizer(family: str, out_dir: str, model_max_length: int) -> TokenIds:
    """Write tokenizer.json and tokenizer_config.json into ``out_dir``; return the ids configs need."""
    tok = build_tokenizer(family)
    tok.save(os.path.join(out_dir, "tokenizer.json"))
    with open(os.path.join(out_dir, "tokenizer_config.json"), "w", encoding="utf-8") as fh:
        json.dump(tokenizer_config(family, model_max_length), fh, indent=2, ensure_ascii=False)
        fh.write("\n")
    return token_ids(family, tok)


def _tojson(
    value: Any, ensure_ascii: bool = False, indent: int | None = None, separators=None, sort_keys=False
) -> str:
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _environment() -> jinja2.sandbox.ImmutableSandboxedEnvironment:
    # The environment transformers' apply_chat_template uses, so templates render the same here.
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    return env


def render_chat_template(
    template: str,
    messages: Sequence[Mapping[str, Any]],
    *,
    tools: Sequence[Mapping[str, Any]] | None = None,
    add_generation_prompt: bool = False,
    **kwargs: Any,
) -> str:
    """Render a chat template as HF ``apply_chat_template(..., tokenize=False)`` would."""
    return (
        _environment()
        .from_string(template)
        .render(messages=list(messages), tools=tools, add_generation_prompt=add_generation_prompt, **kwargs)
    )
