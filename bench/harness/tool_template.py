"""The chat template E3 gives every system it compares (``--chat-template``).

SmolLM2's own template (ChatML) drops the ``tools`` it is given and the assistant's
``tool_calls``, so a server that renders them (ours, through ``tools_into_system``) and
one that drops them (mlx_lm.server) would not see the same prompt. This is the same
ChatML with tools in the Hermes / Qwen2.5 layout: the tools' JSON in the system turn,
each call as ``<tool_call>{"name", "arguments"}</tool_call>``, each result as a user turn
in ``<tool_response>``. Both servers take it, so both prefill the same tokens, and both
parse the calls a reply makes with mlx-lm's ``json_tools`` parser (which mlx-lm infers
from ``<tool_call>`` and ``tool_call.name`` in a template).
"""

from __future__ import annotations

TOOLS_TEMPLATE = """\
{%- if tools %}<|im_start|>system
{% if messages[0]['role'] == 'system' %}{{ messages[0]['content'] }}

{% endif %}# Tools

You may call one or more functions to assist with the user query.

You are provided with function signatures within <tools></tools> XML tags:
<tools>
{% for tool in tools %}{{ tool | tojson }}
{% endfor %}</tools>

For each function call, return a json object with function name and arguments within \
<tool_call></tool_call> XML tags:
<tool_call>
{"name": <function-name>, "arguments": <args-json-object>}
</tool_call><|im_end|>
{% elif messages[0]['role'] == 'system' %}<|im_start|>system
{{ messages[0]['content'] }}<|im_end|>
{% endif %}
{%- for message in messages %}
{%- if message['role'] == 'system' and loop.first %}
{%- elif message['role'] == 'assistant' %}<|im_start|>assistant
{% if message['content'] %}{{ message['content'] }}{% endif %}
{%- for call in message['tool_calls'] or [] %}
{%- set tool_call = call['function'] if call['function'] is defined else call %}
{% if message['content'] or not loop.first %}
{% endif %}<tool_call>
{"name": "{{ tool_call.name }}", "arguments": {{ tool_call.arguments | tojson }}}
</tool_call>
{%- endfor %}<|im_end|>
{% elif message['role'] == 'tool' %}<|im_start|>user
<tool_response>
{{ message['content'] }}
</tool_response><|im_end|>
{% else %}<|im_start|>{{ message['role'] }}
{{ message['content'] }}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""
