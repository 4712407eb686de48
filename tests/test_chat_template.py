"""Chat templates render like transformers, inside a sandbox that refuses templates reaching for Python internals, and
in worker processes that stop a render at its time, output or memory limit."""

from __future__ import annotations

import datetime
import os
import signal

import pytest

from mtp.io.chat_template import ChatTemplateError, ChatTemplateLimitError, fallback_chat_prompt, render_chat_template
from mtp.io.template_worker import TemplateWorkers

# Modelled on Qwen3's template: system prompt merged into the tools block, tool schemas through tojson, a namespace
# that finds the last real user query (assistant turns after it keep their <think> block), loop.index/first/last.
QWEN_TEMPLATE = r"""{%- if tools %}
    {{- '<|im_start|>system\n' }}
    {%- if messages[0].role == 'system' %}
        {{- messages[0].content + '\n\n' }}
    {%- endif %}
    {{- "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n<tools>" }}
    {%- for tool in tools %}
        {{- "\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\n</tools><|im_end|>\n" }}
{%- else %}
    {%- if messages[0].role == 'system' %}
        {{- '<|im_start|>system\n' + messages[0].content + '<|im_end|>\n' }}
    {%- endif %}
{%- endif %}
{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}
{%- for message in messages[::-1] %}
    {%- set index = (messages|length) - loop.index %}
    {%- if ns.multi_step_tool and message.role == "user" and not message.content.startswith('<tool_response>') %}
        {%- set ns.multi_step_tool = false %}
        {%- set ns.last_query_index = index %}
    {%- endif %}
{%- endfor %}
{%- for message in messages %}
    {%- set content = message.content if message.content is string else '' %}
    {%- if message.role == "user" or (message.role == "system" and not loop.first) %}
        {{- '<|im_start|>' + message.role + '\n' + content + '<|im_end|>\n' }}
    {%- elif message.role == "assistant" %}
        {%- set reasoning_content = message.reasoning_content if message.reasoning_content is string else '' %}
        {%- if '</think>' in content %}
            {%- set reasoning_content = content.split('</think>')[0].rstrip('\n').split('<think>')[-1].lstrip('\n') %}
            {%- set content = content.split('</think>')[-1].lstrip('\n') %}
        {%- endif %}
        {%- if loop.index0 > ns.last_query_index and reasoning_content %}
            {{- '<|im_start|>assistant\n<think>\n' + reasoning_content.strip('\n') + '\n</think>\n\n' + content }}
        {%- else %}
            {{- '<|im_start|>assistant\n' + content }}
        {%- endif %}
        {%- for tool_call in message.tool_calls or [] %}
            {%- if content or not loop.first %}
                {{- '\n' }}
            {%- endif %}
            {{- '<tool_call>\n{"name": "' + tool_call.function.name + '", "arguments": ' }}
            {{- tool_call.function.arguments | tojson }}
            {{- '}\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\n' }}
    {%- elif message.role == "tool" %}
        {%- if loop.first or messages[loop.index0 - 1].role != "tool" %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\n<tool_response>\n' + content + '\n</tool_response>' }}
        {%- if loop.last or messages[loop.index0 + 1].role != "tool" %}
            {{- '<|im_end|>\n' }}
        {%- endif %}
    {%- elif not (message.role == "system" and loop.first) %}
        {{- raise_exception('Unexpected message role: ' + message.role) }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\n\n</think>\n\n' }}
    {%- endif %}
{%- endif %}
"""

CHAT = [
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "What is 2+2?"},
    {"role": "assistant", "content": "<think>\nSmall sum.\n</think>\n\n2+2 equals 4."},
    {"role": "user", "content": "And 3+3?"},
]

CHAT_EXPECTED = (
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n"
    "<|im_start|>assistant\n2+2 equals 4.<|im_end|>\n"  # reasoning of earlier turns is dropped
    "<|im_start|>user\nAnd 3+3?<|im_end|>\n"
    "<|im_start|>assistant\n"
)

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Météo <now> & later",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
        },
    }
]

TOOL_CHAT = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Weather in Zürich?"},
    {
        "role": "assistant",
        "content": "",
        "reasoning_content": "Need the tool.",
        "tool_calls": [{"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Zürich"}}}],
    },
    {"role": "tool", "content": "12°C"},
]

# ensure_ascii=False and no HTML escaping: é, <, >, &, ü and ° appear as themselves.
TOOL_EXPECTED = (
    "<|im_start|>system\nBe brief.\n\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\n<tools>\n"
    '{"type": "function", "function": {"name": "get_weather", "description": "Météo <now> & later", '
    '"parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}'
    "\n</tools><|im_end|>\n"
    "<|im_start|>user\nWeather in Zürich?<|im_end|>\n"
    # after the last user query, so the namespace keeps this turn's reasoning
    "<|im_start|>assistant\n<think>\nNeed the tool.\n</think>\n\n"
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Zürich"}}\n</tool_call><|im_end|>\n'
    "<|im_start|>user\n<tool_response>\n12°C\n</tool_response><|im_end|>\n"
    "<|im_start|>assistant\n"
)


def test_qwen_style_template_renders_exactly():
    assert render_chat_template(QWEN_TEMPLATE, CHAT) == CHAT_EXPECTED
    assert render_chat_template(QWEN_TEMPLATE, CHAT, add_generation_prompt=False) == CHAT_EXPECTED.removesuffix(
        "<|im_start|>assistant\n"
    )


def test_qwen_style_template_with_tools():
    assert render_chat_template(QWEN_TEMPLATE, TOOL_CHAT, tools=TOOLS) == TOOL_EXPECTED


def test_extra_variables_reach_the_template():
    out = render_chat_template(QWEN_TEMPLATE, CHAT, enable_thinking=False)
    assert out == CHAT_EXPECTED + "<think>\n\n</think>\n\n"
    # tools and documents are always defined (None when not given), as in transformers
    assert render_chat_template("{{ tools is none }} {{ documents is none }} {{ foo is defined }}", CHAT) == "True True False"
    assert render_chat_template("{{ foo }}", CHAT, foo="bar", tools=[{"name": "t"}]) == "bar"
    template = "{{ bos_token }}{{ messages[0].content }}{{ eos_token }}"
    assert render_chat_template(template, CHAT, bos_token="<s>", eos_token="</s>") == "<s>You are a helpful assistant.</s>"


def test_tojson_options():
    template = "{{ messages[0] | tojson(indent=2, sort_keys=true) }}|{{ messages[0] | tojson(separators=(',', ':')) }}"
    out = render_chat_template(template, [{"role": "user", "content": "ü<"}])
    assert out == '{\n  "content": "ü<",\n  "role": "user"\n}|{"role":"user","content":"ü<"}'


def test_matches_transformers():
    # Same output as transformers' own renderer, for both chats (skipped where transformers is not installed).
    chat_template_utils = pytest.importorskip("transformers.utils.chat_template_utils")
    for chat, kwargs in ((CHAT, {}), (TOOL_CHAT, {"tools": TOOLS}), (CHAT, {"enable_thinking": False})):
        rendered, _ = chat_template_utils.render_jinja_template(
            conversations=[chat], chat_template=QWEN_TEMPLATE, add_generation_prompt=True, **kwargs
        )
        assert render_chat_template(QWEN_TEMPLATE, chat, **kwargs) == rendered[0]


@pytest.mark.parametrize(
    "template",
    [
        "{{ ''.__class__.__mro__[1].__subclasses__() }}",
        "{{ cycler.__init__.__globals__ }}",
        "{{ ''.__class__ }}",  # Jinja alone would render this as '' and carry on
        "{{ messages | attr('__class__') }}",
        "{{ '{0.__class__}'.format(1) }}",
        "{{ messages.append(1) }}",  # the sandbox is immutable: no mutating the caller's messages
        "{% set ns = namespace(__dict__=1) %}",
    ],
)
def test_python_internals_are_refused(template):
    with pytest.raises(ChatTemplateError, match="unsafe"):
        render_chat_template(template, CHAT)


def test_raise_exception_surfaces_the_templates_message():
    template = (
        "{% for m in messages %}{% if m.role not in ['user', 'assistant'] %}{{ raise_exception('bad role') }}{% endif %}{% endfor %}"
    )
    with pytest.raises(ChatTemplateError, match="bad role"):
        render_chat_template(template, CHAT)
    assert render_chat_template(template, CHAT[1:]) == ""


def test_loopcontrols_break():
    template = "{% for m in messages %}{% if loop.index > 1 %}{% break %}{% endif %}{{ m.content }}{% endfor %}"
    assert render_chat_template(template, CHAT) == "You are a helpful assistant."


def test_block_whitespace_like_transformers():
    # trim_blocks drops the newline after a block tag, lstrip_blocks the indentation before it.
    template = "{% for m in messages %}\n    {% if m.role == 'user' %}\n{{ m.content }}\n    {% endif %}\n{% endfor %}"
    assert render_chat_template(template, CHAT) == "What is 2+2?\nAnd 3+3?\n"


def test_strftime_now():
    out = render_chat_template("{{ strftime_now('%Y') }}", CHAT)
    # Either side of a year boundary passes.
    assert out in {str(datetime.date.today().year), str((datetime.date.today() - datetime.timedelta(days=1)).year)}


def test_syntax_error_names_the_line():
    with pytest.raises(ChatTemplateError, match="syntax error at line 2"):
        render_chat_template("{% for m in messages %}\n{{ m.content }\n{% endfor %}", CHAT)
    with pytest.raises(ChatTemplateError, match="syntax error"):
        render_chat_template("{% for m in messages %}{{ m.content }}", CHAT)


def test_template_is_compiled_once():
    from mtp.io import chat_template

    template = "{{ messages | length }} compile-once"
    before = chat_template._compile.cache_info()
    assert render_chat_template(template, CHAT) == render_chat_template(template, CHAT[:1]).replace("1", "4")
    after = chat_template._compile.cache_info()
    assert (after.misses - before.misses, after.hits - before.hits) == (1, 1)


def test_fallback_prompt():
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    assert fallback_chat_prompt(messages, add_generation_prompt=True) == "system: Be brief.\nuser: Hi\nassistant:"
    assert fallback_chat_prompt(messages, add_generation_prompt=False) == "system: Be brief.\nuser: Hi\n"


def test_output_limit_stops_the_render():
    assert render_chat_template("{{ 'x' * 10 }}", CHAT, max_chars=10) == "x" * 10
    with pytest.raises(ChatTemplateLimitError, match="output exceeded the limit of 10 characters") as e:
        render_chat_template("{{ 'x' * 11 }}", CHAT, max_chars=10)
    assert e.value.limit == "output"
    with pytest.raises(ChatTemplateLimitError):  # stopped at the first piece past the limit, not at the end
        render_chat_template("{% for i in range(100000) %}{% for j in range(100000) %}x{% endfor %}{% endfor %}", CHAT,
                             max_chars=1000)


# ---- the worker processes (io/template_worker.py) -----------------------------------------------------------
LOOPS = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"


@pytest.fixture(scope="module")
def workers():
    w = TemplateWorkers(workers=1, timeout_s=1.0)
    yield w
    w.close()


def test_a_worker_renders_exactly_as_in_process(workers):
    assert workers.render(QWEN_TEMPLATE, CHAT) == render_chat_template(QWEN_TEMPLATE, CHAT) == CHAT_EXPECTED
    assert workers.render(QWEN_TEMPLATE, TOOL_CHAT, tools=TOOLS) == TOOL_EXPECTED
    with pytest.raises(ChatTemplateError, match="bad role"):
        workers.render("{{ raise_exception('bad role') }}", CHAT)
    with pytest.raises(ChatTemplateError, match="unsafe"):
        workers.render("{{ ''.__class__ }}", CHAT)


@pytest.mark.parametrize("template,limit,words", [
    (LOOPS, "time", "the chat template exceeded the time limit of 1 s"),
    ("{{ 'x' * 10**6 }}", "output", "output exceeded the limit of 1000 characters"),
    ("{{ 'x' | center(10**10) }}", "memory", "exceeded the memory limit of 1024 MiB"),  # one C call of 10 GB
])
def test_a_worker_stops_a_render_at_each_limit_and_serves_on(workers, template, limit, words):
    with pytest.raises(ChatTemplateLimitError, match=words) as e:
        workers.render(template, CHAT, max_chars=1000)
    assert e.value.limit == limit
    assert workers.render(QWEN_TEMPLATE, CHAT) == CHAT_EXPECTED


def test_a_stuck_or_dead_worker_is_replaced(workers):
    proc = workers._all[0].proc
    os.kill(proc.pid, signal.SIGSTOP)  # stands for a C call that its own timer cannot interrupt
    with pytest.raises(ChatTemplateLimitError, match="time limit of 1 s"):
        workers.render(QWEN_TEMPLATE, CHAT)
    assert proc.poll() is not None  # killed
    assert workers.render(QWEN_TEMPLATE, CHAT) == CHAT_EXPECTED
    workers._all[0].proc.kill()  # died between renders: started afresh
    workers._all[0].proc.wait()
    assert workers.render(QWEN_TEMPLATE, CHAT) == CHAT_EXPECTED
