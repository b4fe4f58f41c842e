#!/usr/bin/env python3
"""Recipe of env.json: small templates rendered by Jinja2 in Hugging Face's
chat-template environment (transformers' render_jinja_template: an
ImmutableSandboxedEnvironment with trim_blocks, lstrip_blocks and loop
controls; tojson as json.dumps(ensure_ascii=False, ...); raise_exception;
strftime_now pinned to 2026-01-15). Run: python3 env.py > env.json"""
import json
from datetime import datetime

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment


def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)


def strftime_now(fmt):
    return datetime(2026, 1, 15, 9, 5, 7).strftime(fmt)


env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
env.filters["tojson"] = tojson
env.globals["raise_exception"] = raise_exception
env.globals["strftime_now"] = strftime_now

DATA = {
    "tools": [{"type": "function", "function": {"name": "f", "description": "<a> & \"b\" é ✓ 😀", "parameters": {"z": 1, "a": [1.5, 100.0, 1e-07, 1e16, True, None, "\u2028\u0001\x7f"]}}}],
    "messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}, {"role": "user", "content": "bye"}],
}

TEMPLATES = {
    "trim_blocks": "{% for m in messages %}\n{{ m.role }}\n{% endfor %}\nend\n",
    "lstrip_blocks": "<x>\n    {% if true %}\n    in\n    {% endif %}\n</x>",
    "lstrip_inline": "a  {% if true %}b{% endif %}  c\n  {{ 'e' }}",
    "whitespace_control": "a \n {%- if true -%} \n b \n {%- endif %} c",
    "comment_trim": "a\n  {# note #}\nb",
    "loop_controls": "{% for i in range(10) %}{% if i == 2 %}{% continue %}{% endif %}{% if i > 4 %}{% break %}{% endif %}{{ i }}{% endfor %}",
    "loop_vars": "{% for m in messages %}{{ loop.index }}/{{ loop.length }}{{ ',' if not loop.last }}{% endfor %}",
    "tojson_plain": "{{ tools | tojson }}",
    "tojson_indent": "{{ tools | tojson(indent=2) }}",
    "tojson_separators": "{{ tools[0].function.parameters | tojson(separators=(',', ':')) }}",
    "tojson_sort_keys": "{{ tools[0].function | tojson(sort_keys=true) }}",
    "tojson_ensure_ascii": "{{ tools[0].function.description | tojson(ensure_ascii=true) }}",
    "strftime": "{{ strftime_now('%d %b %Y') }}|{{ strftime_now('%Y-%m-%d %H:%M:%S %A %B %j %I%p') }}",
    "namespace": "{% set ns = namespace(n=0) %}{% for m in messages if m.role == 'user' %}{% set ns.n = ns.n + 1 %}{% endfor %}{{ ns.n }}",
    "raise": "{{ raise_exception('custom failure: ' ~ messages[0].role) }}",
    "macro": "{% macro r(m) %}[{{ m.role }}:{{ m.content }}]{% endmacro %}{% for m in messages %}{{ r(m) }}{% endfor %}",
    "string_methods": "{{ '  Hi There  '.strip() }}|{{ 'a,b'.split(',') | join('+') }}|{{ 'abc'.startswith('a') }}|{{ 'x'.upper() }}",
    "filters": "{{ messages | map(attribute='role') | join(',') }}|{{ messages | selectattr('role', 'equalto', 'user') | list | length }}|{{ messages[-1].content | trim }}",
}

out = []
for name, src in TEMPLATES.items():
    try:
        out.append({"name": name, "template": src, "output": env.from_string(src).render(**DATA)})
    except jinja2.exceptions.TemplateError as e:
        out.append({"name": name, "template": src, "error": str(e)})
print(json.dumps({"jinja2": jinja2.__version__, "data": DATA, "cases": out}, ensure_ascii=False, indent=1))
