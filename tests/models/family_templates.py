"""The chat format of each tiny family: a Jinja chat template written here from the
family's published prompt format, and the special tokens it needs.

Each ``FamilyChat`` names the tokens the family's tokenizer adds (``added``: special,
``plain``: added but not special, as the real tokenizers mark them, e.g. Qwen's
``<tool_call>`` / ``<think>``), its end-of-turn tokens (``eos``: the first is the
tokenizer's ``eos_token``, all of them the config's ``eos_token_id``) and the template.
``tiny_families`` appends the tokens to the shared byte-level tokenizer (ids from
``tiny_models.VOCAB_SIZE`` on) and writes the template into ``tokenizer_config.json``,
so a tiny model renders, tokenizes and is parsed as its family's checkpoints are.

The templates are ours (written from each format's description: the turn markers, where
tools, tool calls and tool results go, the thinking switch), not copies of the
checkpoints' files. Three choices differ from some published templates, on purpose:
message text is written as given (never trimmed: a reply sent back re-tokenizes to the
tokens the model produced), consecutive messages of one role are allowed (clients send
them), and an unknown role renders as a user turn instead of raising.

Formats (the tool-call format as promptcache detects and parses it):

- ``LLAMA3``: Llama 3.1-3.3 headers (``<|start_header_id|>role<|end_header_id|>``,
  ``<|eot_id|>``); tools in the system turn, a call is one bare JSON object
  ``{"name": N, "parameters": ARGS}``, results in an ``ipython`` turn (Hermes fallback
  parser: a bare JSON call counts).
- ``QWEN3``: ChatML, ``<think>`` with the ``enable_thinking`` switch (off: an empty think
  block opens the reply), calls ``<tool_call>\\n{"name", "arguments"}\\n</tool_call>``
  (``json_tools``), results ``<tool_response>`` in a user turn.
- ``QWEN3_CODER``: ChatML, the tools as ``<function>`` listings, calls
  ``<tool_call>\\n<function=N>\\n<parameter=P>\\nV\\n</parameter>\\n</function>\\n
  </tool_call>`` (``qwen3_coder``, ours); no thinking switch.
- ``QWEN3_5``: ``QWEN3_CODER``'s tools and calls, and thinking on by default (the reply
  opens in ``<think>\\n``; off: ``<think>\\n\\n</think>\\n\\n``).
- ``NEMOTRON3``: ChatML with a system turn always, Qwen3-Coder XML calls, thinking
  (``<think>\\n`` open; off: ``<think></think>``), earlier replies with an empty think.
- ``FALCON_H1``: ChatML, tools in ``<tools>``, calls ``<tool_call>`` JSON.
- ``GEMMA3``: ``<start_of_turn>user`` / ``model``, the system text at the start of the
  first user turn; no tools (the server's fallback puts them into the first turn).
- ``HARMONY``: gpt-oss: ``<|start|>ROLE<|message|>...<|end|>``, a system turn with the
  valid channels, tools as a TypeScript-like ``namespace functions`` in the developer
  turn, answers in ``<|channel|>final``, calls
  ``<|channel|>commentary to=functions.N <|constrain|>json<|message|>ARGS<|call|>``,
  results ``<|start|>functions.N to=assistant<|channel|>commentary<|message|>...``.
- ``DEEPSEEK_V31``: ``<｜User｜>`` / ``<｜Assistant｜>``, the ``thinking`` switch
  (``<think>`` or ``</think>`` after the assistant marker), calls
  ``<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>N<｜tool▁sep｜>ARGS<｜tool▁call▁end｜>
  <｜tool▁calls▁end｜>``, results ``<｜tool▁output▁begin｜>...<｜tool▁output▁end｜>``.
- ``GLM47``: ``[gMASK]<sop>``, ``<|system|>`` / ``<|user|>`` / ``<|assistant|>`` /
  ``<|observation|>``, ``<think>`` / ``</think>`` after the assistant marker, calls
  ``<tool_call>N<arg_key>K</arg_key><arg_value>V</arg_value></tool_call>``.
- ``KIMI_K2``: ``<|im_system|>`` / ``<|im_user|>`` / ``<|im_assistant|>`` with
  ``<|im_middle|>``, tools declared in a ``tool_declare`` turn, calls
  ``<|tool_calls_section_begin|><|tool_call_begin|>functions.N:I
  <|tool_call_argument_begin|>ARGS<|tool_call_end|><|tool_calls_section_end|>``.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class FamilyChat:
    name: str  # the published format the template follows
    template: str
    eos: tuple[str, ...]
    added: tuple[str, ...] = ()  # special tokens the tokenizer adds
    plain: tuple[str, ...] = ()  # added tokens that are not special
    bos: str | None = None


# helpers shared by the templates: a message's text (a string or text parts), tool-call
# arguments as JSON (a mapping, or a JSON string as some clients send them), a tool's
# function (OpenAI's {"type": "function", "function": {...}} or the function itself)
_MACROS = r"""
{%- macro text(c) -%}
{%- if c is string -%}{{ c }}
{%- elif c -%}{%- for p in c -%}{%- if p.type == 'text' -%}{{ p.text }}{%- endif -%}{%- endfor -%}
{%- endif -%}
{%- endmacro -%}
{%- macro args_json(a) -%}
{%- if a is string -%}{{ a }}{%- else -%}{{ a | tojson }}{%- endif -%}
{%- endmacro -%}
{%- macro value(v) -%}
{%- if v is string -%}{{ v }}{%- else -%}{{ v | tojson }}{%- endif -%}
{%- endmacro -%}
"""


def _t(body: str) -> str:
    return (_MACROS + body).strip()


LLAMA3 = FamilyChat("Llama 3.1-3.3 (JSON tool calls)", _t(r"""
{{- '<|begin_of_text|>' }}
{%- set rest = messages %}
{%- set sys = '' %}
{%- if messages and messages[0].role == 'system' %}
{%- set sys = text(messages[0].content) %}
{%- set rest = messages[1:] %}
{%- endif %}
{%- if sys or tools %}
{{- '<|start_header_id|>system<|end_header_id|>\n\n' }}
{%- if tools %}{{- 'Environment: ipython\n\n' }}{%- endif %}
{{- sys }}
{%- if tools %}
{{- '\n\nThese functions can be called. To call one, answer with nothing but a JSON object {"name": the function name, "parameters": an object of its arguments}.\n\n' }}
{%- for tool in tools %}{{- (tool.function if tool.function is defined else tool) | tojson }}{{- '\n\n' }}{%- endfor %}
{%- endif %}
{{- '<|eot_id|>' }}
{%- endif %}
{%- for message in rest %}
{%- if message.role == 'assistant' %}
{{- '<|start_header_id|>assistant<|end_header_id|>\n\n' }}
{%- if message.tool_calls %}
{%- for tool_call in message.tool_calls %}
{%- if tool_call.function is defined %}{%- set tool_call = tool_call.function %}{%- endif %}
{%- if not loop.first %}{{- '\n' }}{%- endif %}
{{- '{"name": "' + tool_call.name + '", "parameters": ' + args_json(tool_call.arguments) + '}' }}
{%- endfor %}
{%- else %}{{- text(message.content) }}
{%- endif %}
{{- '<|eot_id|>' }}
{%- elif message.role == 'tool' or message.role == 'ipython' %}
{{- '<|start_header_id|>ipython<|end_header_id|>\n\n' + text(message.content) + '<|eot_id|>' }}
{%- else %}
{{- '<|start_header_id|>' + message.role + '<|end_header_id|>\n\n' + text(message.content) + '<|eot_id|>' }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{%- endif %}
"""), eos=("<|eot_id|>", "<|eom_id|>", "<|end_of_text|>"),
    added=("<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>",
           "<|end_header_id|>", "<|eot_id|>", "<|eom_id|>", "<|python_tag|>"),
    bos="<|begin_of_text|>")

# ChatML turns with tool results grouped into one user turn of <tool_response> blocks
_CHATML_TURNS = r"""
{%- elif message.role == 'tool' %}
{%- if loop.first or loop.previtem.role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}
{{- '\n<tool_response>\n' + text(message.content) + '\n</tool_response>' }}
{%- if loop.last or loop.nextitem.role != 'tool' %}{{- '<|im_end|>\n' }}{%- endif %}
{%- else %}
{{- '<|im_start|>' + message.role + '\n' + text(message.content) + '<|im_end|>\n' }}
{%- endif %}
"""

# the index of the last user turn that is not tool results (the reasoning of replies
# after it is kept)
_LAST_QUERY = r"""
{%- set ns = namespace(last_query=-1) %}
{%- for message in messages %}
{%- if message.role == 'user' %}{%- set ns.last_query = loop.index0 %}{%- endif %}
{%- endfor %}
"""

# every message, the system one skipped (written first); an assistant message split
# into its reasoning and its text (from reasoning_content or a <think> block), opened
_ASSISTANT_OPEN = r"""{%- for message in messages %}
{%- if loop.first and message.role == 'system' %}
{%- elif message.role == 'assistant' %}
{%- set content = text(message.content) %}
{%- set reasoning = message.reasoning_content if message.reasoning_content is string else '' %}
{%- if '</think>' in content %}
{%- set reasoning = content.split('</think>')[0].split('<think>')[-1].strip('\n') %}
{%- set content = content.split('</think>')[-1].lstrip('\n') %}
{%- endif %}
{{- '<|im_start|>assistant\n' }}
"""

# an assistant message's tool calls as Hermes / Qwen3 JSON in <tool_call> tags
_JSON_CALLS = r"""{%- for tool_call in message.tool_calls or [] %}
{%- if tool_call.function is defined %}{%- set tool_call = tool_call.function %}{%- endif %}
{%- if content or not loop.first %}{{- '\n' }}{%- endif %}
{{- '<tool_call>\n{"name": "' + tool_call.name + '", "arguments": ' + args_json(tool_call.arguments) + '}\n</tool_call>' }}
{%- endfor %}
"""

QWEN3 = FamilyChat("Qwen3 (ChatML, JSON tool calls, thinking switch)", _t(r"""
{%- set first = 0 %}
{%- if tools %}
{{- '<|im_start|>system\n' }}
{%- if messages[0].role == 'system' %}{{- text(messages[0].content) + '\n\n' }}{%- endif %}
{{- '# Tools\n\nFunctions you may call, one JSON signature per line in <tools></tools>:\n<tools>' }}
{%- for tool in tools %}{{- '\n' + tool | tojson }}{%- endfor %}
{{- '\n</tools>\n\nCall a function by writing its name and arguments as JSON in <tool_call></tool_call> tags:\n<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call><|im_end|>\n' }}
{%- elif messages[0].role == 'system' %}
{{- '<|im_start|>system\n' + text(messages[0].content) + '<|im_end|>\n' }}
{%- endif %}
""" + _LAST_QUERY + r"""
""" + _ASSISTANT_OPEN + r"""{%- if loop.index0 > ns.last_query and reasoning %}{{- '<think>\n' + reasoning + '\n</think>\n\n' }}{%- endif %}
{{- content }}
""" + _JSON_CALLS + r"""{{- '<|im_end|>\n' }}
""" + _CHATML_TURNS + r"""
{%- endfor %}
{%- if add_generation_prompt %}
{{- '<|im_start|>assistant\n' }}
{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\n\n</think>\n\n' }}{%- endif %}
{%- endif %}
"""), eos=("<|im_end|>", "<|endoftext|>"),
    plain=("<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<think>",
           "</think>"))


# Qwen3-Coder's tools (a <function> listing) and calls (XML), shared by the XML families
_XML_TOOLS = r"""
{{- '# Tools\n\nYou can call these functions:\n\n<tools>' }}
{%- for tool in tools %}
{%- set fn = tool.function if tool.function is defined else tool %}
{{- '\n<function>\n<name>' + fn.name + '</name>' }}
{%- if fn.description is defined and fn.description %}{{- '\n<description>' + fn.description + '</description>' }}{%- endif %}
{{- '\n<parameters>' + (fn.parameters if fn.parameters is defined else {}) | tojson + '</parameters>\n</function>' }}
{%- endfor %}
{{- '\n</tools>\n\nTo call a function, write exactly:\n<tool_call>\n<function=example_function_name>\n<parameter=example_parameter_1>\nvalue_1\n</parameter>\n<parameter=example_parameter_2>\nvalue_2\n</parameter>\n</function>\n</tool_call>\nEvery required parameter must be given; a value may span several lines. Text may come before a call, never after it.' }}
"""

_XML_CALLS = r"""
{%- for tool_call in message.tool_calls or [] %}
{%- if tool_call.function is defined %}{%- set tool_call = tool_call.function %}{%- endif %}
{%- if content or not loop.first %}{{- '\n' }}{%- endif %}
{{- '<tool_call>\n<function=' + tool_call.name + '>\n' }}
{%- if tool_call.arguments is mapping %}
{%- for key, val in tool_call.arguments.items() %}
{{- '<parameter=' + key + '>\n' + value(val) + '\n</parameter>\n' }}
{%- endfor %}
{%- endif %}
{{- '</function>\n</tool_call>' }}
{%- endfor %}
"""


def _xml_chatml(*, think_history: str, gen_on: str, gen_off: str,
                system_always: bool, thinking: bool) -> str:
    """A ChatML template with Qwen3-Coder XML tools. ``think_history``: what a reply
    before the last user turn writes before its text; ``gen_on`` / ``gen_off``: what
    the generation prompt adds with thinking on / off (``thinking``: the template reads
    ``enable_thinking``)."""
    system = r"""
{%- set sys = text(messages[0].content) if messages and messages[0].role == 'system' else '' %}
{%- if tools or sys or SYSTEM_ALWAYS %}
{{- '<|im_start|>system\n' + sys }}
{%- if tools %}{%- if sys %}{{- '\n\n' }}{%- endif %}""" + _XML_TOOLS + r"""{%- endif %}
{{- '<|im_end|>\n' }}
{%- endif %}
""".replace("SYSTEM_ALWAYS", "true" if system_always else "false")
    body = r"""
""" + _ASSISTANT_OPEN + r"""{%- if loop.index0 > ns.last_query %}THINK_RECENT{%- else %}THINK_HISTORY{%- endif %}
{{- content }}""" + _XML_CALLS + r"""
{{- '<|im_end|>\n' }}
""" + _CHATML_TURNS + r"""
{%- endfor %}
{%- if add_generation_prompt %}
{{- '<|im_start|>assistant\n' }}
""" + (r"""{%- if enable_thinking is defined and enable_thinking is false %}GEN_OFF{%- else %}GEN_ON{%- endif %}"""
       if thinking else "") + r"""
{%- endif %}
"""
    recent = (r"""{{- '<think>\n' + reasoning + '\n</think>\n\n' }}""" if thinking else "")
    body = (body.replace("THINK_RECENT", recent)
            .replace("THINK_HISTORY", think_history)
            .replace("GEN_OFF", gen_off).replace("GEN_ON", gen_on))
    return _t(system + _LAST_QUERY + body)


QWEN3_CODER = FamilyChat("Qwen3-Coder (ChatML, XML tool calls)", _xml_chatml(
    think_history="", gen_on="", gen_off="", system_always=False,
    thinking=False), eos=("<|im_end|>", "<|endoftext|>"),
    plain=("<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<think>",
           "</think>"))

QWEN3_5 = FamilyChat("Qwen3.5 (ChatML, XML tool calls, thinking on by default)", _xml_chatml(
    think_history="", gen_on=r"""{{- '<think>\n' }}""",
    gen_off=r"""{{- '<think>\n\n</think>\n\n' }}""", system_always=False, thinking=True),
    eos=("<|im_end|>", "<|endoftext|>"),
    plain=("<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<think>",
           "</think>"))

NEMOTRON3 = FamilyChat("Nemotron 3 (ChatML, XML tool calls, thinking)", _xml_chatml(
    think_history=r"""{{- '<think></think>' }}""",
    gen_on=r"""{{- '<think>\n' }}""", gen_off=r"""{{- '<think></think>' }}""",
    system_always=True, thinking=True),
    eos=("<|im_end|>",),
    added=("<think>", "</think>", "<tool_call>", "</tool_call>", "<tool_response>",
           "</tool_response>"))

FALCON_H1 = FamilyChat("Falcon-H1 (ChatML, JSON tool calls)", _t(r"""
{{- '<|begin_of_text|>' }}
{%- set sys = text(messages[0].content) if messages and messages[0].role == 'system' else '' %}
{%- if tools %}
{{- '<|im_start|>system\n' }}
{%- if sys %}{{- sys + '\n\n' }}{%- endif %}
{{- 'You may call functions to answer. Their signatures, in <tools></tools>:\n<tools>\n' }}
{%- for tool in tools %}{{- tool | tojson + '\n' }}{%- endfor %}
{{- '</tools>\nFor each call write one JSON object with the function name and arguments in <tool_call></tool_call> tags:\n<tool_call>\n{"name": <function-name>, "arguments": <args-dict>}\n</tool_call><|im_end|>\n' }}
{%- elif sys %}
{{- '<|im_start|>system\n' + sys + '<|im_end|>\n' }}
{%- endif %}
{%- for message in messages %}
{%- if loop.first and message.role == 'system' %}
{%- elif message.role == 'assistant' %}
{%- set content = text(message.content) %}
{{- '<|im_start|>assistant\n' + content }}
""" + _JSON_CALLS + r"""{{- '<|im_end|>\n' }}
""" + _CHATML_TURNS + r"""
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}{%- endif %}
"""), eos=("<|im_end|>", "<|end_of_text|>"),
    added=("<|begin_of_text|>", "<|end_of_text|>", "<tool_call>", "</tool_call>",
           "<tool_response>", "</tool_response>"),
    bos="<|begin_of_text|>")

GEMMA3 = FamilyChat("Gemma 3 (no tool format)", _t(r"""
{{- '<bos>' }}
{%- set rest = messages %}
{%- set sys = '' %}
{%- if messages and messages[0].role == 'system' %}
{%- set sys = text(messages[0].content) + '\n\n' %}
{%- set rest = messages[1:] %}
{%- endif %}
{%- for message in rest %}
{%- set role = 'model' if message.role == 'assistant' else 'user' %}
{{- '<start_of_turn>' + role + '\n' + (sys if loop.first else '') + text(message.content) + '<end_of_turn>\n' }}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<start_of_turn>model\n' }}{%- endif %}
"""), eos=("<end_of_turn>", "<eos>"),
    added=("<bos>", "<eos>", "<pad>", "<start_of_turn>", "<end_of_turn>"), bos="<bos>")

# TypeScript-like types of a JSON schema (harmony's tool declarations)
_TS = r"""
{%- macro ts(s) -%}
{%- if s.enum is defined -%}{%- for e in s.enum -%}{{ e | tojson }}{%- if not loop.last %} | {% endif -%}{%- endfor -%}
{%- elif s.type == 'string' -%}string
{%- elif s.type == 'integer' or s.type == 'number' -%}number
{%- elif s.type == 'boolean' -%}boolean
{%- elif s.type == 'array' -%}{{ ts(s['items']) if s['items'] is defined else 'any' }}[]
{%- elif s.type == 'object' and s.properties is defined -%}{
{%- for key, sub in s.properties.items() %} {{ key }}{{ '' if key in (s.required or []) else '?' }}: {{ ts(sub) }},{%- endfor %} }
{%- else -%}any
{%- endif -%}
{%- endmacro -%}
"""

HARMONY = FamilyChat("gpt-oss harmony", _t(_TS + r"""
{%- set sys = text(messages[0].content) if messages and messages[0].role in ('system', 'developer') else '' %}
{{- '<|start|>system<|message|>You are a helpful assistant.\nKnowledge cutoff: 2024-06\n\nReasoning: ' + (reasoning_effort if reasoning_effort is defined else 'medium') + '\n\n# Valid channels: analysis, commentary, final. Channel must be included for every message.' }}
{%- if tools %}{{- "\nCalls to these tools must go to the commentary channel: 'functions'." }}{%- endif %}
{{- '<|end|>' }}
{%- if sys or tools %}
{{- '<|start|>developer<|message|>' }}
{%- if sys %}{{- '# Instructions\n\n' + sys }}{%- if tools %}{{- '\n\n' }}{%- endif %}{%- endif %}
{%- if tools %}
{{- '# Tools\n\n## functions\n\nnamespace functions {\n\n' }}
{%- for tool in tools %}
{%- set fn = tool.function if tool.function is defined else tool %}
{%- if fn.description is defined and fn.description %}{{- '// ' + fn.description + '\n' }}{%- endif %}
{%- set params = fn.parameters if fn.parameters is defined else {} %}
{%- if params.properties is defined and params.properties %}
{{- 'type ' + fn.name + ' = (_: ' + ts(params) + ') => any;\n\n' }}
{%- else %}
{{- 'type ' + fn.name + ' = () => any;\n\n' }}
{%- endif %}
{%- endfor %}
{{- '} // namespace functions' }}
{%- endif %}
{{- '<|end|>' }}
{%- endif %}
{%- for message in messages %}
{%- if loop.first and message.role in ('system', 'developer') %}
{%- elif message.role == 'assistant' %}
{%- set content = text(message.content) %}
{%- set analysis = message.reasoning_content if message.reasoning_content is string else '' %}
{%- if message.tool_calls %}
{%- if analysis %}{{- '<|start|>assistant<|channel|>analysis<|message|>' + analysis + '<|end|>' }}{%- endif %}
{%- if content %}{{- '<|start|>assistant<|channel|>commentary<|message|>' + content + '<|end|>' }}{%- endif %}
{%- for tool_call in message.tool_calls %}
{%- if tool_call.function is defined %}{%- set tool_call = tool_call.function %}{%- endif %}
{{- '<|start|>assistant<|channel|>commentary to=functions.' + tool_call.name + ' <|constrain|>json<|message|>' + args_json(tool_call.arguments) + '<|call|>' }}
{%- endfor %}
{%- else %}
{{- '<|start|>assistant<|channel|>final<|message|>' + content + '<|end|>' }}
{%- endif %}
{%- elif message.role == 'tool' %}
{%- set ns = namespace(name='') %}
{%- for other in messages %}
{%- for tc in other.tool_calls or [] %}
{%- if tc.id is defined and tc.id == message.tool_call_id %}{%- set ns.name = (tc.function if tc.function is defined else tc).name %}{%- endif %}
{%- endfor %}
{%- endfor %}
{%- if not ns.name %}{%- set ns.name = message.name if message.name is defined and message.name else 'tool' %}{%- endif %}
{{- '<|start|>functions.' + ns.name + ' to=assistant<|channel|>commentary<|message|>' + text(message.content) + '<|end|>' }}
{%- elif message.role in ('system', 'developer') %}
{{- '<|start|>developer<|message|>' + text(message.content) + '<|end|>' }}
{%- else %}
{{- '<|start|>user<|message|>' + text(message.content) + '<|end|>' }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|start|>assistant' }}{%- endif %}
"""), eos=("<|return|>", "<|call|>", "<|endoftext|>"),
    added=("<|startoftext|>", "<|start|>", "<|end|>", "<|message|>", "<|channel|>",
           "<|constrain|>", "<|return|>", "<|call|>"))

# DeepSeek's markers (full-width bars and the "▁" of its vocabulary)
DEEPSEEK_TOKENS = ("<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜User｜>",
                   "<｜Assistant｜>", "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>",
                   "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>",
                   "<｜tool▁outputs▁begin｜>", "<｜tool▁outputs▁end｜>",
                   "<｜tool▁output▁begin｜>", "<｜tool▁output▁end｜>")

DEEPSEEK_V31 = FamilyChat("DeepSeek V3.1", _t(r"""
{%- set ns = namespace(sys='', after_tool=false) %}
{%- for message in messages %}
{%- if message.role == 'system' %}{%- set ns.sys = ns.sys + ('\n\n' if ns.sys else '') + text(message.content) %}{%- endif %}
{%- endfor %}
{{- '<｜begin▁of▁sentence｜>' + ns.sys }}
{%- if tools %}
{{- ('\n\n' if ns.sys else '') + '## Tools\nYou have access to the following tools:\n' }}
{%- for tool in tools %}
{%- set fn = tool.function if tool.function is defined else tool %}
{{- '\n### ' + fn.name + '\nDescription: ' + (fn.description if fn.description is defined and fn.description else '') + '\n\nParameters: ' + (fn.parameters if fn.parameters is defined else {}) | tojson + '\n' }}
{%- endfor %}
{{- '\nTo use tools, write exactly this (several calls go one after another inside the outer markers):\n<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>tool_call_name<｜tool▁sep｜>tool_call_arguments<｜tool▁call▁end｜><｜tool▁calls▁end｜>\nwhere tool_call_name is the name of the tool and tool_call_arguments its arguments as a JSON object.\n' }}
{%- endif %}
{%- for message in messages %}
{%- if message.role == 'user' %}
{{- '<｜User｜>' + text(message.content) }}
{%- set ns.after_tool = false %}
{%- elif message.role == 'assistant' %}
{%- set content = text(message.content) %}
{%- if '</think>' in content %}{%- set content = content.split('</think>')[-1] %}{%- endif %}
{%- if not ns.after_tool %}{{- '<｜Assistant｜></think>' }}{%- endif %}
{{- content }}
{%- if message.tool_calls %}
{{- '<｜tool▁calls▁begin｜>' }}
{%- for tool_call in message.tool_calls %}
{%- if tool_call.function is defined %}{%- set tool_call = tool_call.function %}{%- endif %}
{{- '<｜tool▁call▁begin｜>' + tool_call.name + '<｜tool▁sep｜>' + args_json(tool_call.arguments) + '<｜tool▁call▁end｜>' }}
{%- endfor %}
{{- '<｜tool▁calls▁end｜>' }}
{%- endif %}
{{- '<｜end▁of▁sentence｜>' }}
{%- set ns.after_tool = false %}
{%- elif message.role == 'tool' %}
{{- '<｜tool▁output▁begin｜>' + text(message.content) + '<｜tool▁output▁end｜>' }}
{%- set ns.after_tool = true %}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt and not ns.after_tool %}
{{- '<｜Assistant｜>' }}
{%- if thinking is defined and thinking %}{{- '<think>' }}{%- else %}{{- '</think>' }}{%- endif %}
{%- endif %}
"""), eos=("<｜end▁of▁sentence｜>",), added=DEEPSEEK_TOKENS, plain=("<think>", "</think>"),
    bos="<｜begin▁of▁sentence｜>")

GLM47 = FamilyChat("GLM-4.7", _t(r"""
{{- '[gMASK]<sop>' }}
{%- if tools %}
{{- '<|system|>\n# Tools\n\nFunctions you may call, their signatures in <tools></tools>:\n<tools>\n' }}
{%- for tool in tools %}{{- tool | tojson + '\n' }}{%- endfor %}
{{- '</tools>\n\nWrite each call as the function name, then each argument as a key and a value:\n<tool_call>{function-name}<arg_key>{arg-key-1}</arg_key><arg_value>{arg-value-1}</arg_value><arg_key>{arg-key-2}</arg_key><arg_value>{arg-value-2}</arg_value>...</tool_call>' }}
{%- endif %}
""" + _LAST_QUERY + r"""
{%- for message in messages %}
{%- if message.role == 'system' %}
{{- '<|system|>' + text(message.content) }}
{%- elif message.role == 'user' %}
{{- '<|user|>' + text(message.content) }}
{%- elif message.role == 'assistant' %}
{%- set content = text(message.content) %}
{%- set reasoning = message.reasoning_content if message.reasoning_content is string else '' %}
{%- if '</think>' in content %}
{%- set reasoning = content.split('</think>')[0].split('<think>')[-1] %}
{%- set content = content.split('</think>')[-1] %}
{%- endif %}
{{- '<|assistant|>' }}
{%- if loop.index0 > ns.last_query and reasoning %}{{- '<think>' + reasoning + '</think>' }}{%- else %}{{- '</think>' }}{%- endif %}
{{- content }}
{%- for tool_call in message.tool_calls or [] %}
{%- if tool_call.function is defined %}{%- set tool_call = tool_call.function %}{%- endif %}
{{- '<tool_call>' + tool_call.name }}
{%- if tool_call.arguments is mapping %}
{%- for key, val in tool_call.arguments.items() %}
{{- '<arg_key>' + key + '</arg_key><arg_value>' + value(val) + '</arg_value>' }}
{%- endfor %}
{%- endif %}
{{- '</tool_call>' }}
{%- endfor %}
{%- elif message.role == 'tool' %}
{%- if loop.first or loop.previtem.role != 'tool' %}{{- '<|observation|>' }}{%- endif %}
{{- '<tool_response>' + text(message.content) + '</tool_response>' }}
{%- else %}
{{- '<|user|>' + text(message.content) }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
{{- '<|assistant|>' }}
{%- if enable_thinking is defined and enable_thinking is false %}{{- '</think>' }}{%- else %}{{- '<think>' }}{%- endif %}
{%- endif %}
"""), eos=("<|endoftext|>", "<|user|>", "<|observation|>"),
    added=("[gMASK]", "<sop>", "<|system|>", "<|user|>", "<|assistant|>", "<|observation|>",
           "<think>", "</think>", "<tool_call>", "</tool_call>", "<arg_key>", "</arg_key>",
           "<arg_value>", "</arg_value>", "<tool_response>", "</tool_response>"))

KIMI_K2 = FamilyChat("Kimi-K2", _t(r"""
{%- if tools %}
{{- '<|im_system|>tool_declare<|im_middle|>' + tools | tojson + '<|im_end|>' }}
{%- endif %}
{%- for message in messages %}
{%- if message.role == 'assistant' %}
{{- '<|im_assistant|>assistant<|im_middle|>' + text(message.content) }}
{%- if message.tool_calls %}
{{- '<|tool_calls_section_begin|>' }}
{%- for tool_call in message.tool_calls %}
{%- set call_id = tool_call.id if tool_call.id is defined and tool_call.id and tool_call.id.startswith('functions.') else none %}
{%- if tool_call.function is defined %}{%- set tool_call = tool_call.function %}{%- endif %}
{{- '<|tool_call_begin|>' + (call_id or 'functions.' + tool_call.name + ':' + loop.index0 | string) + '<|tool_call_argument_begin|>' + args_json(tool_call.arguments) + '<|tool_call_end|>' }}
{%- endfor %}
{{- '<|tool_calls_section_end|>' }}
{%- endif %}
{{- '<|im_end|>' }}
{%- elif message.role == 'tool' %}
{%- set ns = namespace(ref=message.tool_call_id or '') %}
{%- for other in messages %}
{%- for tc in other.tool_calls or [] %}
{%- if tc.id is defined and tc.id == message.tool_call_id and not tc.id.startswith('functions.') %}{%- set ns.ref = 'functions.' + (tc.function if tc.function is defined else tc).name + ':' + loop.index0 | string %}{%- endif %}
{%- endfor %}
{%- endfor %}
{{- '<|im_system|>tool<|im_middle|>## Return of ' + ns.ref + '\n' + text(message.content) + '<|im_end|>' }}
{%- elif message.role == 'system' %}
{{- '<|im_system|>system<|im_middle|>' + text(message.content) + '<|im_end|>' }}
{%- else %}
{{- '<|im_user|>user<|im_middle|>' + text(message.content) + '<|im_end|>' }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_assistant|>assistant<|im_middle|>' }}{%- endif %}
"""), eos=("<|im_end|>",),
    added=("[BOS]", "[EOS]", "<|im_user|>", "<|im_assistant|>", "<|im_system|>",
           "<|im_middle|>", "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>",
           "<|tool_call_begin|>", "<|tool_call_argument_begin|>", "<|tool_call_end|>"))

BY_FAMILY: dict[str, FamilyChat] = {
    "llama": LLAMA3, "qwen3": QWEN3, "qwen3_moe": QWEN3_CODER, "gpt_oss": HARMONY,
    "gemma3_text": GEMMA3, "qwen3_5": QWEN3_5, "qwen3_5_moe": QWEN3_5,
    "qwen3_next": QWEN3_CODER, "nemotron_h": NEMOTRON3, "falcon_h1": FALCON_H1,
    "deepseek_v3": DEEPSEEK_V31, "glm4_moe_lite": GLM47, "kimi_linear": KIMI_K2,
    "qwen3_4bit": QWEN3,
}
