#!/usr/bin/env python3
"""gen_vectors.py -- Writes tests/chat/vectors.json: what Python's jinja2, configured exactly as
HF transformers configures it for chat templates, renders for

  * "jinja": language cases (a template, its variables, the whitespace flags), the reference for
    text/jinja.c (tests/test_jinja.c);
  * "chat": every chat template of ../shared/testdata/tokenizers/*/tokenizer_config.json and of
    tests/chat/templates/*.jinja, over a set of conversations, with and without the generation
    prompt, the reference for text/chat_template.c (tests/test_chat_template.c);
  * "no_template": the tokenizer directories without a chat template (a clear error in C).

transformers' environment (utils/chat_template_utils.py, _compile_jinja_template):
ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[a
{% generation %} tag, jinja2.ext.loopcontrols]); the tojson filter replaced by
json.dumps(x, ensure_ascii=False, indent=indent, separators=separators, sort_keys=sort_keys);
globals raise_exception (raises TemplateError(message)) and strftime_now. apply_chat_template
renders with messages, tools=None, documents=None, add_generation_prompt and the tokenizer's
special tokens (special_tokens_map: the ones that are set).

usage: gen_vectors.py [--shared DIR] [--out FILE]   write the vectors
       gen_vectors.py --check                        exit 1 if vectors.json is not what this
                                                     script writes now (77: no jinja2 here)
Needs jinja2 (Debian: python3-jinja2).
"""
import argparse
import json
import os
import sys
from datetime import datetime, timezone

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
NOW = 1700000000  # what strftime_now formats in the language cases (UTC; the C test sets TZ)

try:
    import jinja2
    import jinja2.ext
    import jinja2.nodes
    from jinja2.sandbox import ImmutableSandboxedEnvironment
except ImportError:
    print("gen_vectors.py: jinja2 is not importable (Debian: apt-get install python3-jinja2)",
          file=sys.stderr)
    sys.exit(77)


class GenerationTag(jinja2.ext.Extension):
    """{% generation %}...{% endgeneration %} renders its body in place, as transformers'
    assistant-token tracker does when no tracking is asked for."""
    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(["name:endgeneration"], drop_needle=True)
        call = self.call_method("_render_body")
        return jinja2.nodes.CallBlock(call, [], [], body).set_lineno(lineno)

    def _render_body(self, caller):
        return caller()


def make_env(hf_whitespace, now=None):
    if hf_whitespace:
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                            extensions=[GenerationTag, jinja2.ext.loopcontrols])
    else:
        env = ImmutableSandboxedEnvironment(extensions=[GenerationTag, jinja2.ext.loopcontrols])

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                          sort_keys=sort_keys)

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def strftime_now(fmt):
        t = datetime.fromtimestamp(now, timezone.utc) if now is not None else datetime.now()
        return t.strftime(fmt)

    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    return env


def render(env, source, variables):
    """{"output": text} or {"error": message, "raised": bool} (raised: raise_exception)."""
    try:
        return {"output": env.from_string(source).render(**variables)}
    except jinja2.exceptions.TemplateSyntaxError as e:
        return {"error": str(e), "raised": False, "syntax": True}
    except jinja2.exceptions.TemplateError as e:
        return {"error": str(e), "raised": type(e) is jinja2.exceptions.TemplateError}
    except Exception as e:  # TypeError, ZeroDivisionError, ... as jinja2 lets them through
        return {"error": "%s: %s" % (type(e).__name__, e), "raised": False}


# ---- language cases: (name, template, variables, whitespace) ----
# whitespace "hf": trim_blocks + lstrip_blocks (transformers); "plain": jinja2's defaults.
MSGS = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": None}]
THINK = [{"role": "user", "content": "<think>\nx\n</think>\n\nans"},
         {"role": "assistant", "content": "plain"}]
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Weather «now» for a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "description": "City name"},
        "days": {"type": "integer"}}, "required": ["city"]}}}]
TOOL_CHAT = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call00001", "type": "function",
         "function": {"name": "get_weather", "arguments": {"city": "Paris", "days": 2,
                                                            "unit": None}}}]},
    {"role": "tool", "content": {"temp": 21.5, "sky": "clear"}},
    {"role": "assistant", "content": "21.5 degrees and clear."},
]

LANG = [
    # scoping
    ("loop_scope", "{% set x = 0 %}{% for i in range(3) %}{{ x }}{% set x = x + 1 %}{{ x }}{% endfor %}|{{ x }}", {}),
    ("loop_scope_fresh", "{% for i in range(3) %}[{{ y }}]{% set y = i %}{{ y }}{% endfor %}|{{ y }}", {}),
    ("loop_scope_if", "{% set y = 5 %}{% for i in range(3) %}[{{ y }}]{% if i == 1 %}{% set y = i %}{% endif %}{{ y }}{% endfor %}|{{ y }}", {}),
    ("if_scope_leaks", "{% if true %}{% set a = 1 %}{% endif %}{{ a }}", {}),
    ("with_scope", "{% with a = 1, b = 2 %}{{ a + b }}{% endwith %}[{{ a }}]", {}),
    ("set_block", "{% set s %}\n  block {{ 1 }}\n{% endset %}[{{ s }}]", {}),
    ("set_block_filter", "{% set s | upper %}ab{{ 'c' }}{% endset %}{{ s }}", {}),
    ("set_tuple", "{% set a, b = 1, 2 %}{{ a }}{{ b }}{% set c, d = [3, 4] %}{{ c }}{{ d }}", {}),
    ("set_tuple_bad", "{% set a, b = 1, 2, 3 %}", {}),
    ("namespace", "{% set ns = namespace(a=1, b='x') %}{% set ns.a = ns.a + 1 %}{{ ns.a }}{{ ns.b }}{{ ns.c }}{{ ns }}", {}),
    ("namespace_cycle", "{% set ns = namespace() %}{% set ns.x = 1 %}{% set ns.self = ns %}{{ ns.self.x }}{% set ns.l = [ns, ns] %}{{ ns.l | length }}", {}),
    ("namespace_set_bad", "{% set x = 1 %}{% set x.y = 2 %}", {}),
    ("namespace_dict", "{% set ns = namespace({'a': 1}, b=2) %}{{ ns.a }}{{ ns.b }}{{ ns['a'] }}", {}),
    # undefined
    ("undef_print", "[{{ u }}][{{ u|string }}][{{ u|length }}][{{ u|list }}][{{ u|default('d') }}]", {}),
    ("undef_attr_error", "{{ u.x }}", {}),
    ("undef_add_error", "{{ u + 'a' }}", {}),
    ("undef_concat", "{{ u ~ 'a' }}|{{ none ~ 'a' }}|{{ 1 ~ 2.5 }}", {}),
    ("undef_tests", "{{ u is defined }}{{ u is undefined }}{{ u is iterable }}{{ u is sequence }}{{ u is mapping }}{{ u is none }}{{ not u }}", {}),
    ("undef_in", "{{ 'a' in u }}", {}),
    ("undef_in_str", "{{ u in 'abc' }}", {}),
    ("none_attr", "{{ none.x }}|{{ none.x is defined }}", {}),
    ("missing_items", "{{ [1,2][5] }}|{{ 'abc'[1] }}|{{ {'a':1}['b'] }}|{{ d.nokey }}|{{ d['nokey'] is defined }}", {"d": {"k": 1}}),
    ("undef_compare", "{{ u < 1 }}", {}),
    ("undef_eq", "{{ u == u }}{{ u == none }}{{ u != 1 }}", {}),
    ("undef_call", "{{ foo() }}", {}),
    ("undef_iter", "{% for x in u %}x{% else %}none{% endfor %}", {}),
    # values and printing
    ("floats", "{{ 1.0 }} {{ 1e20 }} {{ 1e16 }} {{ 1e15 }} {{ 0.0001 }} {{ 0.00001 }} {{ 1/3 }} {{ 10/2 }} {{ 2**-1 }} {{ 1.5e300 * 1e10 }} {{ -0.0 }} {{ 123456789.123 }} {{ 0.1 + 0.2 }}", {}),
    ("ints", "{{ 7//2 }} {{ -7//2 }} {{ -7 % 3 }} {{ 7 % -3 }} {{ 2**10 }} {{ 7.5 // 2 }} {{ -7.5 % 2 }} {{ 1_000 + 0x10 + 0o7 + 0b11 }} {{ 1.5e1 + 2E-1 }}", {}),
    ("reprs", "{{ none }}|{{ true }}|{{ [1,'a',none,true,1.5] }}|{{ {'a':1,'b':[1]} }}|{{ (1,2) }}|{{ ('a',) }}|{{ () }}", {}),
    ("repr_quotes", "{{ [\"it's\", 'say \"x\"', \"both ' \\\"\", 'a\\nb\\t\\x01é\\u2028\\\\'] }}", {}),
    ("dict_views", "{{ {'a':1}.keys() }}{{ {'a':1}.values() }}{{ {'a':1}.items() }}", {}),
    ("string_escapes", "{{ 'a\\tb\\\\n\\x41\\u00e9\\101\\\nc' }}|{{ \"a\" \"b\" 'c' }}|{{ '\\d\\q' }}", {}),
    ("unicode_literal", "{{ 'héllo 😀 日本' }}|{{ 'héllo😀'|length }}|{{ 'héllo😀'[::-1] }}|{{ 'héllo'[1] }}", {}),
    ("json_values", "{{ v }}|{{ v.f }}|{{ v.l[1] }}|{{ v.n is none }}|{{ v.b }}", {"v": {"f": 1.25, "l": [1, "x"], "n": None, "b": False}}),
    # operators
    ("arith_errors_str_int", "{{ 'a' + 1 }}", {}),
    ("arith_neg_str", "{{ -'a' }}", {}),
    ("div_zero", "{{ 1 / 0 }}", {}),
    ("mod_zero", "{{ 1 % 0 }}", {}),
    ("repeat", "{{ 'ab' * 3 }}{{ [1] * 2 }}{{ 3 * 'c' }}{{ 'x' * 0 }}{{ 'x' * -1 }}", {}),
    ("list_concat", "{{ [1,2] + [3] }}{{ (1,) + (2,) }}", {}),
    ("precedence", "{{ not 1 == 2 }}{{ not 'a' in 'abc' }}{{ 'a' not in 'abc' }}{{ 2 ** 3 ** 2 }}{{ -2 ** 2 }}{{ 1 + 2 * 3 - 4 / 2 }}{{ 1 if 0 else 2 if 0 else 3 }}", {}),
    ("concat_precedence", "{{ 'a' ~ 1 + 2 }}", {}),
    ("concat_precedence2", "{{ 1 + 2 ~ 'a' ~ 3 * 2 }}", {}),
    ("and_or_values", "{{ '' or 'x' }}|{{ 'a' and 'b' }}|{{ 0 and 1 }}|{{ none or [] }}|{{ u or 'd' }}", {}),
    ("compare", "{{ 1 == 1.0 }}{{ true == 1 }}{{ [1,2] == [1,2] }}{{ {'a':1,'b':2} == {'b':2,'a':1} }}{{ (1,2) == [1,2] }}{{ 'a' < 'b' }}{{ [1,2] < [1,3] }}{{ 1 < 2 < 3 }}{{ 3 > 2 > 2 }}{{ 'B' < 'a' }}", {}),
    ("compare_error", "{{ 1 < 'a' }}", {}),
    ("in_ops", "{{ 'b' in 'abc' }}{{ '' in 'abc' }}{{ 2 in [1,2] }}{{ 'k' in {'k': 1} }}{{ 'z' not in {'k': 1} }}{{ 1.0 in [1] }}", {}),
    ("in_none", "{{ 'a' in none }}", {}),
    ("ternary", "{{ x if true }}|{{ 'y' if false }}|{{ 'a' if 1 else 'b' }}", {}),
    ("slices", "{{ [1,2,3,4][1:3] }}{{ [1,2,3,4][::-1] }}{{ 'hello'[1:] }}{{ 'hello'[-2:] }}{{ [1,2,3][::2] }}{{ [1,2,3,4,5][-2:0:-1] }}{{ 'abcdef'[::-2] }}{{ [1,2,3][5:] }}{{ (1,2,3)[1:] }}{{ 'abc'[:-1] }}", {}),
    ("slice_step_zero", "{{ [1][::0] }}", {}),
    ("subscripts", "{%- set x = {'a': {'b': [1,2]}} -%}{{ x.a.b[1] }}{{ x['a']['b'].0 }}{{ x.a['b'][-1] }}{{ x['items'] is defined }}", {}),
    # statements
    ("if_elif", "{% if 1 %}a{% elif 2 %}b{% else %}c{% endif %}{% if 0 %}a{% elif 2 %}b{% else %}c{% endif %}{% if 0 %}a{% elif 0 %}b{% else %}c{% endif %}", {}),
    ("for_dict", "{% for a, b in {'x': 1, 'y': 2}.items() %}{{ a }}={{ b }};{% endfor %}{% for k in {'x':1} %}{{k}}{% endfor %}{% for c in 'ab' %}{{ c }}{% endfor %}", {}),
    ("for_else", "{% for x in [] %}a{% else %}empty{% endfor %}{% for x in [1] %}a{% else %}empty{% endfor %}", {}),
    ("for_loop_vars", "{% for x in [1,2,3] if x > 1 %}{{ loop.index }}/{{ loop.length }}{{ loop.first }}{{ loop.last }}{{ loop.revindex }}{{ loop.revindex0 }}{{ loop.index0 }}{{ loop.previtem }}{{ loop.nextitem }}{{ loop.cycle('a','b') }}{{ loop.depth }};{% endfor %}", {}),
    ("for_nested_loop", "{% for a in [1,2] %}{% for b in 'xy' %}{{ loop.index }}{{ b }}{% endfor %}{{ loop.index }};{% endfor %}", {}),
    ("for_unpack_bad", "{% for a, b in [[1,2,3]] %}{{a}}{% endfor %}", {}),
    ("for_over_none", "{% for a in none %}{% endfor %}", {}),
    ("loop_controls", "{% for i in range(10) %}{% if i == 2 %}{% continue %}{% endif %}{% if i == 5 %}{% break %}{% endif %}{{ i }}{% endfor %}", {}),
    ("range", "{{ range(3)|list }}{{ range(1,10,3)|list }}{{ range(5,0,-2)|list }}{{ range(0)|list }}", {}),
    ("range_too_big", "{{ range(100001)|length }}", {}),
    ("macro", "{% macro m(a, b='B') %}<{{ a }}{{ b }}{{ c }}{{ varargs }}{{ kwargs }}>{% endmacro %}{% set c = 'C' %}{{ m(1) }}{{ m(1, 2) }}{{ m(b=3, a=4) }}{{ m(1,2,3,z=4) }}", {}),
    ("macro_defaults_see_args", "{% macro m(a, b=a ~ '!') %}{{ a }}{{ b }}{% endmacro %}{{ m('x') }}", {}),
    ("macro_too_many", "{% macro m(a) %}{{ a }}{% endmacro %}{{ m(1, 2) }}", {}),
    ("macro_missing_arg", "{% macro m(a) %}[{{ a }}]{% endmacro %}{{ m() }}|{{ m }}", {}),
    ("macro_recursive", "{% macro fact(n) %}{% if n <= 1 %}1{% else %}{{ n * fact(n - 1)|int }}{% endif %}{% endmacro %}{{ fact(6) }}", {}),
    ("call_block", "{% macro m() %}[{{ caller() }}]{% endmacro %}{% call m() %}body{{ 1 }}{% endcall %}", {}),
    ("call_block_args", "{% macro m(x) %}[{{ caller(x) }}|{{ caller(x * 2) }}]{% endmacro %}{% set k = 'K' %}{% call(v) m(7) %}got {{ v }}{{ k }}{% endcall %}", {}),
    ("filter_block", "{% filter upper %}hello {{ 'x' }}{% endfilter %}{% filter replace('a', 'b')|title %}aa ca{% endfilter %}", {}),
    ("print_stmt", "{% print 1 + 1 %}{% print 'a', 'b' %}", {}),
    ("generation_tag", "a{% generation %}gen {{ 1 }}{% endgeneration %}b", {}),
    ("raise", "{{ raise_exception('boom: ' ~ 42) }}", {}),
    ("raise_in_loop", "{% for m in messages %}{% if m.role == 'assistant' %}{{ raise_exception('no assistant at ' ~ loop.index0) }}{% endif %}{{ m.content }}{% endfor %}", {"messages": MSGS}),
    ("strftime_now", "{{ strftime_now('%Y-%m-%d %H:%M %b %B %a %A %d') }}", {}),
    # filters
    ("f_length", "{{ 'abc'|length }}{{ [1,2]|count }}{{ {'a':1}|length }}{{ 'é😀'|length }}", {}),
    ("f_length_int", "{{ 1|length }}", {}),
    ("f_trim_case", "{{ '  x  '|trim }}|{{ 'xxaxx'|trim('x') }}|{{ 'hello world'|title }}|{{ \"they're bill's\"|title }}|{{ 'hELLO wORLD'|capitalize }}|{{ 'a-b c(d'|title }}|{{ 'ÉTÉ'|lower }}|{{ 'éa'|upper }}|{{ '\u00a0 nbsp \u3000'|trim }}", {}),
    ("f_sort", "{{ [3,1,2]|sort }}{{ [3,1,2]|sort(reverse=true) }}{{ ['b','A','a']|sort }}{{ ['b','A','a']|sort(case_sensitive=true) }}{{ [[2, 'b'], [1, 'a']]|sort }}{{ [{'a': 2, 'n': 'x'}, {'a': 1, 'n': 'y'}]|sort(attribute='a')|map(attribute='n')|join }}", {}),
    ("f_sort_stable", "{{ [{'k': 1, 'i': 1}, {'k': 0, 'i': 2}, {'k': 1, 'i': 3}, {'k': 0, 'i': 4}]|sort(attribute='k', reverse=true)|map(attribute='i')|list }}{{ users|sort(attribute='age,name')|map(attribute='name')|join(',') }}", {"users": [{"name": "b", "age": 2}, {"name": "a", "age": 2}, {"name": "c", "age": 1}]}),
    ("f_sort_mixed", "{{ [1, 'a']|sort }}", {}),
    ("f_unique_reverse", "{{ ['b','A','a']|unique|list }}{{ ['a','A','b','B']|unique(case_sensitive=true)|list }}{{ [1,2]|reverse|list }}{{ 'abc'|reverse }}{{ {'a': 1, 'b': 2}|reverse|list }}", {}),
    ("f_join", "{{ [1,2,3]|join(',') }}{{ [1,2]|join }}{{ [{'n':'a'},{'n':'b'}]|join(', ', attribute='n') }}{{ 'abc'|join('-') }}", {}),
    ("f_default", "{{ u|default('d') }}|{{ none|default('d') }}|{{ ''|default('d', true) }}|{{ u|d('x') }}|{{ u|default }}|{{ 0|d(5, boolean=true) }}", {}),
    ("f_int_float", "{{ 3.7|int }}{{ '42'|int }}{{ '4.5'|int }}{{ 'x'|int }}{{ '0x1A'|int(0, 16) }}{{ '3'|float }}{{ 'x'|float }}{{ ' 12 '|int }}{{ '1_000'|int }}{{ true|int }}{{ none|int }}{{ '1e3'|float }}{{ 'inf'|float }}{{ 'x'|int(-1) }}{{ '-8'|int }}{{ 2|float }}", {}),
    ("f_list_items", "{{ 'abc'|list }}{{ {'a':1,'b':2}|list }}{{ {'a':1}|items|list }}{{ u|items|list }}{{ (1, 2)|list }}", {}),
    ("f_items_bad", "{{ [1]|items|list }}", {}),
    ("f_round_abs", "{{ 2.5|round }}{{ 3.5|round }}{{ 2.567|round(2) }}{{ 2.5|round(0, 'floor') }}{{ -3|abs }}{{ 2|round }}{{ 2.675|round(2) }}{{ 1234|round(-2) }}{{ 0.5|round }}{{ 1.5|round }}{{ 42.55|round(1,'floor') }}{{ 42.55|round(1,'ceil') }}{{ -2.5|abs }}", {}),
    ("f_escape_safe", "{{ '<a href=\"x\">&\\''|e }}|{{ '<a>'|safe }}|{{ '<a>'|escape }}|{{ none|e }}", {}),
    ("f_select_map", "{{ msgs|selectattr('role', 'equalto', 'user')|list|length }}{{ msgs|rejectattr('role', 'equalto', 'user')|map(attribute='content')|list }}{{ msgs|map(attribute='x', default='D')|list }}{{ msgs|selectattr('x')|list }}{{ msgs|selectattr('x', 'defined')|list }}{{ [1,2,3]|select('odd')|list }}{{ [1,2,3]|reject('odd')|list }}{{ ['a','B']|map('upper')|list }}{{ msgs|map(attribute='role')|join(',') }}{{ [1, 0, 2]|select|list }}{{ ['a', 'b']|map('replace', 'a', 'z')|list }}{{ msgs|selectattr('role', '==', 'assistant')|list|length }}", {"msgs": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b", "x": 1}]}),
    ("f_generators", "{% set x = [1,2,3]|select('odd') %}{{ x|list }}{{ x|list }}{% if x %}T{% endif %}{{ [1,2,3]|select('odd')|first }}{{ 'a' in ['a','b']|reject('eq','b') }}{% if [0]|select %}always{% endif %}", {}),
    ("f_generator_length", "{{ [1, 2]|select|length }}", {}),
    ("f_first_last", "{{ [1, 2, 3] | first }}{{ 'xyz' | last }}{{ {'a': 1} | first }}{{ [] | first }}{{ []|last }}", {}),
    ("f_string", "{{ 5|string + 'x' }}{{ [1]|string }}{{ none|string }}", {}),
    ("f_dictsort", "{% for k, v in d|dictsort %}{{k}}={{v}},{% endfor %}{{ d|dictsort(by='value', reverse=true) }}{{ d|dictsort(true) }}", {"d": {"b": 2, "a": 3, "C": 1}}),
    ("f_minmax_sum", "{{ [3, 1, 2]|max }}{{ ['b','C','a']|min }}{{ [1,2,3]|sum }}{{ [{'p':1},{'p':2}]|sum(attribute='p') }}[{{ []|max }}]{{ [1.5, 2]|sum(start=1) }}", {}),
    ("f_indent", "{{ 'a\\nb\\n\\nc'|indent }}|{{ 'a\\nb'|indent(2, true) }}|{{ 'a\\n\\nb'|indent('> ', blank=true) }}", {}),
    ("f_replace", "{{ 'aaa'|replace('a', 'b', 2) }}{{ 1001|replace(0, 'o') }}{{ 'ab'|replace('', '-') }}", {}),
    ("f_format", "{{ '%s and %d' % ('x', 3) }}|{{ '%5.2f|%-4s|%03d|%x' % (3.14159, 'ab', 7, 255) }}|{{ '%(a)s' % {'a': 1} }}|{{ '%s'|format(1) }}|{{ '%s-%s'|format('a', 'b') }}|{{ '100%%' % () }}", {}),
    ("f_tojson", "{{ 'x' | tojson }} {{ {'a': [1, 2.5, none, true, 'é\\n']} | tojson }} {{ {'a': [1, {}], 'b': []} | tojson(indent=2) }} {{ [1,[2]]|tojson(separators=(',',':')) }} {{ {'b':1,'a':2}|tojson(sort_keys=true) }} {{ 'é😀'|tojson(true) }} {{ {1: 2, none: 3, 1.5: 4, true: 5}|tojson }} {{ (1, 'a')|tojson }} {{ [1]|tojson(indent='\\t') }}", {}),
    ("f_tojson_messages", "{{ messages | tojson }}|{{ messages[0] | tojson(indent=4) }}", {"messages": [{"role": "user", "content": "hi <b> & 'q' \u00e9 \U0001F600 \u0001 \u007f \u2028"}]}),
    ("f_tojson_undefined", "{{ u | tojson }}", {}),
    ("f_attr_center", "{{ {'a': 1}|attr('a') }}|{{ 'abc'|center(9) }}|{{ (none|attr('x')) is defined }}", {}),
    ("f_unknown_deferred", "{% if false %}{{ x | nosuchfilter }}{% endif %}ok{{ 'a' if true else (1|nosuchfilter) }}", {}),
    ("f_unsupported_deferred", "{% if false %}{{ x | wordwrap }}{% endif %}fine", {}),
    # tests
    ("tests", "{{ x is defined and x }}{{ y is not none }}{{ y is none }}{{ 3 is divisibleby 3 }}{{ 4 is odd }}{{ 4 is even }}{{ 'ab' is lower }}{{ 'AB' is upper }}{{ z is sameas none }}{{ 1 is in [1,2] }}{{ 'x' is eq 'x' }}{{ 2 is gt 1 }}{{ 2 is le 1 }}{{ 1 is ne 2 }}{{ 'x' is string }}{{ 1 is string }}{{ {} is mapping }}{{ [] is sequence }}{{ 1.5 is float }}{{ 1 is float }}{{ 1 is integer }}{{ true is integer }}{{ true is number }}{{ true is boolean }}{{ false is false }}{{ 1 is true }}{{ 'a'.upper is callable }}{{ 'a' is callable }}{{ 'upper' is filter }}{{ 'odd' is test }}{{ none is iterable }}{{ 'a' is iterable }}", {"x": 1, "y": None, "z": None}),
    # methods
    ("m_split", "{{ 'a b  c'.split() }}{{ 'a,b,,c'.split(',') }}{{ 'a,b,c'.split(',', 1) }}{{ 'a,b,c'.rsplit(',', 1) }}{{ '  a b  c  '.split(none, 1) }}{{ '  a b  c  '.rsplit(none, 1) }}{{ 'a\\nb\\r\\nc'.splitlines() }}{{ ''.split() }}{{ ''.split(',') }}{{ 'a\u3000b'.split() }}", {}),
    ("m_strip_find", "{{ ' x '.strip() }}{{ 'xyx'.strip('x') }}{{ '\\n\\nab\\n'.lstrip('\\n') }}|{{ 'ab  '.rstrip() }}|{{ 'abc'.startswith(('x','a')) }}{{ 'abc'.endswith('bc') }}{{ 'abc'.startswith('b', 1) }}{{ 'abcabc'.find('c') }}{{ 'abcabc'.find('c', 3) }}{{ 'abcabc'.rfind('b') }}{{ 'héllo'.find('l') }}{{ 'abcabc'.count('bc') }}{{ 'abc'.index('c') }}", {}),
    ("m_index_missing", "{{ 'abc'.index('z') }}", {}),
    ("m_replace_case", "{{ 'aaa'.replace('a','b',2) }}{{ 'ab'.replace('','-') }}{{ 'héllo'.upper() }}{{ 'Hello World'.swapcase() }}{{ \"they're bill's\".title() }}{{ 'hELLO'.capitalize() }}{{ 'ABC'.lower() }}", {}),
    ("m_predicates", "{{ 'ABC'.isupper() }}{{ 'AbC'.isupper() }}{{ '123'.isdigit() }}{{ ''.isdigit() }}{{ ' \\t'.isspace() }}{{ 'ab1'.isalnum() }}{{ 'ab'.isalpha() }}{{ 'ab'.islower() }}", {}),
    ("m_misc", "{{ 'abc'.removeprefix('a') }}{{ 'abc'.removesuffix('c') }}{{ ', '.join(['a', 'b']) }}{{ ''.join('xyz') }}|{{ 'ab'.center(7, '*') }}|{{ '5'.zfill(3) }}|{{ '-5'.zfill(4) }}|{{ 'ab'.ljust(4) }}.|{{ 'ab'.rjust(4, '-') }}|{{ 'a=b=c'.partition('=') }}{{ 'a=b=c'.rpartition('=') }}{{ 'abc'.partition('x') }}{{ 'abc'.rpartition('x') }}", {}),
    ("m_format", "{{ '{} {}'.format(1, 'a') }}|{{ '{0}{name}{0}'.format(1, name='n') }}|{{ '{{x}} {!r}'.format('q') }}", {}),
    ("m_join_bad", "{{ ', '.join([1, 2]) }}", {}),
    ("m_dict", "{{ {'a':1}.get('a') }}{{ {'a':1}.get('b') }}{{ {'a':1}.get('b', 2) }}{{ {'a':1}.values()|list }}{{ {'a': 1}.copy() }}{{ {'a': 1}.items()|list }}{{ d.items()|length }}", {"d": {"x": 1, "y": 2}}),
    ("m_list", "{{ [1, 2, 2].count(2) }}{{ [1, 2].index(2) }}{{ [1, 2].copy() }}", {}),
    ("sandbox_append", "{% set l = [1] %}{{ l.append(2) }}{{ l }}", {}),
    ("sandbox_update", "{% set d = {} %}{{ d.update({'a': 1}) }}", {}),
    ("sandbox_dunder", "[{{ x.__class__ }}][{{ ''.__class__ }}]", {"x": {}}),
    ("dict_literals", "{{ {'a': 1, 'a': 2} }}{{ {1: 'a', 1.0: 'b', true: 'c'} }}{{ dict(a=1, b=2) }}{{ dict({'x': 1}, y=2) }}", {}),
    ("dict_unhashable", "{{ {[1]: 2} }}", {}),
    ("msg_access", "{{ messages[0].content }}{{ messages[0]['role'] }}{{ messages[-1].content }}{{ messages|length }}{{ messages[5] is defined }}{{ messages[1].content is none }}", {"messages": MSGS}),
    ("msg_none_concat", "{{ messages[1].content + 'x' }}", {"messages": MSGS}),
    ("msg_think_split", "{% for m in messages %}{{ m.content.split('</think>')[-1].lstrip('\\n') }}|{{ m.content.split('</think>')[0].rstrip('\\n').split('<think>')[-1].lstrip('\\n') }}|{% endfor %}", {"messages": THINK}),
    ("msg_in_dict", "{% for m in messages %}{{ 'tool_calls' in m }}{{ 'role' in m }}{{ m.tool_calls is defined }}{% endfor %}", {"messages": MSGS}),
    ("msg_dict_eq", "{% set users = messages|selectattr('role', 'equalto', 'user')|list %}{% for m in messages %}{{ m == users[-1] }}{% endfor %}", {"messages": MSGS + [{"role": "user", "content": "hi"}]}),
    ("for_items_if", "{% for k, v in d.items() if k != 'skip' %}{{ k }}:{{ v|tojson }};{{ loop.length }}{% endfor %}", {"d": {"a": [1], "skip": 0, "b": {"c": None}}}),
    # whitespace control (jinja2's lexer rules)
    ("ws_trim_lstrip", "a\n  {% if true %}\n    b\n  {% endif %}\nc", {}),
    ("ws_dash", "  {%- if true -%}  x  {%- endif -%}  \ny", {}),
    ("ws_for_lines", "{% for i in [1,2] %}\n  {{ i }}\n{% endfor %}", {}),
    ("ws_comment", "  {# comment #}\nline", {}),
    ("ws_comment_signs", "a {#- c -#} b {#+ c #}\n  {#+ x +#}\nz", {}),
    ("ws_raw", "{% raw %}{{ not }}{% endraw %}\n  {%- raw -%}  {% x %}  {%- endraw -%}  \nq", {}),
    ("ws_plus", "  {%+ if true %}k{% endif +%}\nm", {}),
    ("ws_var_no_lstrip", "x {{ 1 }}   {% if true %}y{% endif %}\n  {{ 2 }}", {}),
    ("ws_blank_lines", "{% if true %}\n\n{% endif %}\nend", {}),
    ("ws_var_dash", "{{- '  a  ' -}}\n  b  {{- 'c' }}", {}),
    ("ws_trailing_newline", "text with trailing newline\n", {}),
    ("ws_two_trailing_newlines", "text\n\n", {}),
    ("ws_tab", "\t{% if true %}tab{% endif %}", {}),
    ("ws_crlf", "a\r\n{% if true %}\r\nb\r\n{% endif %}\r\nc\rd", {}),
    ("ws_unicode_space", "x\u00a0{%- if true %}y{% endif %}", {}),
    ("ws_line_start", "{% if true %}\n   {% if true %}z{% endif %}\n{% endif %}", {}),
    # syntax errors (jinja2 refuses these at parse time)
    ("syntax_unclosed_tag", "{% if x %}{% endif %", {}),
    ("syntax_for", "{% for %}", {}),
    ("syntax_stray_end", "{% endfor %}", {}),
    ("syntax_unknown_filter", "{{ x | nosuchfilter }}", {}),
    ("syntax_unknown_test", "{{ x is nosuchtest }}", {}),
    ("syntax_missing_end", "{% for x in y %}abc", {}),
    ("syntax_bad_bracket", "{{ (1 ]}}", {}),
    ("syntax_unknown_tag", "{% frobnicate %}", {}),
    ("syntax_comment", "{# never closed", {}),
    ("syntax_string", "{{ 'abc }}", {}),
]

# the test templates rendered with tools through the plain jinja API (chat_message carries
# role and content only)
TOOL_TEMPLATES = ["tools_style.jinja", "mistral_style.jinja"]

CONVERSATIONS = [
    ("system_user", [{"role": "system", "content": "You are a helpful assistant."},
                     {"role": "user", "content": "What is the capital of France?"}]),
    ("multi_turn", [{"role": "user", "content": "Hello!"},
                    {"role": "assistant", "content": "Hi! How can I help you today?"},
                    {"role": "user", "content": "Tell me a joke."}]),
    ("system_multi_turn", [{"role": "system", "content": "  Answer briefly.  "},
                           {"role": "user", "content": "2+2?"},
                           {"role": "assistant", "content": "4"},
                           {"role": "user", "content": "And 3+3?"}]),
    ("unicode", [{"role": "user", "content": "Grüße aus Köln! 😀🎉 日本語のテキスト — \"quotes\" 'and' <tags> & \\backslash\\\nnew line\ttab"}]),
    ("empty_content", [{"role": "user", "content": ""}]),
    ("whitespace_content", [{"role": "user", "content": "  \n padded \n  "}]),
    ("reasoning", [{"role": "user", "content": "Think first."},
                   {"role": "assistant", "content": "<think>\nsome reasoning\n</think>\n\nThe answer."},
                   {"role": "user", "content": "Again?"}]),
    ("special_tokens_in_content", [{"role": "user", "content": "<|im_end|><s>[INST]<|eot_id|>"}]),
    ("none_content", [{"role": "user", "content": "hi"}, {"role": "assistant", "content": None}]),
    ("two_users", [{"role": "user", "content": "first"}, {"role": "user", "content": "second"}]),
    ("assistant_first", [{"role": "assistant", "content": "I start."}, {"role": "user", "content": "ok"}]),
    ("unknown_role", [{"role": "narrator", "content": "Once upon a time"}]),
]

SHARED_TOKENIZERS = ["llama3", "mistral", "qwen3", "stories260k"]


def special_tokens(cfg):
    """The special tokens apply_chat_template passes (special_tokens_map: the ones set)."""
    out = {}
    for key in ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token",
                "mask_token"):
        v = cfg.get(key)
        if isinstance(v, dict):
            v = v.get("content")
        if v:
            out[key] = v
    extra = [t.get("content") if isinstance(t, dict) else t
             for t in cfg.get("additional_special_tokens") or []]
    if extra:
        out["additional_special_tokens"] = extra
    return out


def chat_template_of(cfg):
    t = cfg.get("chat_template")
    if isinstance(t, list):
        t = {e["name"]: e["template"] for e in t}.get("default")
    return t


def build(shared):
    lang = []
    for name, src, variables in LANG:
        for ws in ("hf", "plain"):
            if ws == "plain" and not name.startswith("ws_"):
                continue
            env = make_env(ws == "hf", now=NOW)
            case = {"name": name + ("" if ws == "hf" else "/plain"), "template": src,
                    "vars": variables, "hf_whitespace": ws == "hf"}
            case.update(render(env, src, variables))
            lang.append(case)
    env = make_env(True, now=NOW)
    for fname in TOOL_TEMPLATES:
        src = open(os.path.join(HERE, "templates", fname), encoding="utf-8").read()
        for with_tools in (False, True):
            variables = {"messages": TOOL_CHAT if fname == "tools_style.jinja" else TOOL_CHAT[1:2],
                         "tools": TOOLS if with_tools else None, "documents": None,
                         "add_generation_prompt": True, "bos_token": "<s>", "eos_token": "</s>"}
            case = {"name": "tools/%s/%s" % (fname, "tools" if with_tools else "no_tools"),
                    "template": src, "vars": variables, "hf_whitespace": True}
            case.update(render(env, src, variables))
            lang.append(case)

    chat, no_template = [], []
    sources = []
    for name in SHARED_TOKENIZERS:
        path = os.path.join(shared, "testdata", "tokenizers", name, "tokenizer_config.json")
        cfg = json.load(open(path, encoding="utf-8"))
        src = chat_template_of(cfg)
        if src is None:
            no_template.append(name)
            continue
        sources.append(("tokenizers/" + name, src, special_tokens(cfg)))
    for fname in sorted(os.listdir(os.path.join(HERE, "templates"))):
        if fname.endswith(".jinja"):
            src = open(os.path.join(HERE, "templates", fname), encoding="utf-8").read()
            sources.append(("templates/" + fname, src,
                            {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}))
    env = make_env(True)
    for model, src, toks in sources:
        for conv_name, messages in CONVERSATIONS:
            for agp in (False, True):
                variables = dict(toks, messages=messages, tools=None, documents=None,
                                 add_generation_prompt=agp)
                case = {"model": model, "conversation": conv_name, "messages": messages,
                        "add_generation_prompt": agp}
                if model.startswith("templates/"):
                    case["special_tokens"] = toks
                case.update(render(env, src, variables))
                chat.append(case)
    return {"generator": "tests/chat/gen_vectors.py (jinja2 in transformers' chat-template "
                         "environment)",
            "now": NOW, "jinja": lang, "chat": chat, "no_template": no_template}


def dumps(doc):
    return json.dumps(doc, ensure_ascii=False, indent=1) + "\n"


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shared", default=os.path.join(os.path.dirname(REPO), "shared"),
                    help="the shared data directory (default: ../shared beside the repository)")
    ap.add_argument("--out", default=os.path.join(HERE, "vectors.json"))
    ap.add_argument("--check", action="store_true",
                    help="compare with the existing file instead of writing it")
    args = ap.parse_args()
    if not os.path.isdir(os.path.join(args.shared, "testdata", "tokenizers")):
        print("gen_vectors.py: no %s/testdata/tokenizers" % args.shared, file=sys.stderr)
        return 77
    text = dumps(build(args.shared))
    if args.check:
        old = open(args.out, encoding="utf-8").read() if os.path.exists(args.out) else ""
        if old != text:
            print("gen_vectors.py: %s is not current (jinja2 %s renders differently, or the "
                  "cases changed): run tests/chat/gen_vectors.py and commit the result"
                  % (args.out, jinja2.__version__), file=sys.stderr)
            return 1
        print("gen_vectors.py: %s is current (jinja2 %s)" % (args.out, jinja2.__version__))
        return 0
    with open(args.out, "w", encoding="utf-8") as f:
        f.write(text)
    print("gen_vectors.py: wrote %s (%d language cases, %d chat cases)"
          % (args.out, text.count('"hf_whitespace"'), text.count('"conversation"')))
    return 0


if __name__ == "__main__":
    sys.exit(main())
