// The Jinja engine's semantics, each case what Jinja2 renders with transformers' settings
// (trim_blocks, lstrip_blocks, loop controls). tests/e2e/test_chat_templates.py checks whole
// chat templates against transformers on random conversations.
#include "model/jinja.h"

#include <catch2/catch.hpp>
#include <string>

using baton::StatusCode;
using baton::jinja::Template;
using baton::jinja::Value;

namespace {

std::string render(const std::string& source, const Value& globals = Value::dict()) {
  auto t = Template::parse(source);
  REQUIRE(t.ok());
  auto out = t->render(globals);
  INFO(source);
  REQUIRE(out.ok());
  return *out;
}

}  // namespace

TEST_CASE("jinja: loops, scopes and namespaces") {
  CHECK(render("{% for x in [1, 2, 3] %}{{ loop.index }}{% if not loop.last %},{% endif %}{% endfor %}") == "1,2,3");
  CHECK(render("{% for x in 'ab' %}{{ loop.index0 }}{{ x }}{{ loop.revindex }}{% endfor %}") == "0a21b1");
  // A set inside a loop is the loop's own; a namespace carries values out.
  CHECK(render("{% set x = 1 %}{% for i in [1] %}{% set x = 2 %}{% endfor %}{{ x }}") == "1");
  CHECK(render("{% set ns = namespace(x=1) %}{% for i in [1, 2] %}{% set ns.x = ns.x + i %}{% endfor %}{{ ns.x }}") ==
        "4");
  CHECK(render("{% for a, b in [[1, 2], [3, 4]] %}{{ a * b }} {% endfor %}") == "2 12 ");
  CHECK(render("{% for x in [] %}a{% else %}empty{% endfor %}") == "empty");
  CHECK(render("{% for x in [1, 2, 3, 4] if x is even %}{{ x }}{{ loop.length }}{% endfor %}") == "2242");
  CHECK(render("{% for x in range(5) %}{% if x == 1 %}{% continue %}{% endif %}{% if x == 3 %}{% break %}{% endif "
               "%}{{ x }}{% endfor %}") == "02");
  CHECK(render("{% for k in {'b': 1, 'a': 2} %}{{ k }}{% endfor %}") == "ba");
}

TEST_CASE("jinja: white space control as transformers sets it") {
  CHECK(render("  {% if true %}\nA\n  {% endif %}\nB") == "A\nB");  // lstrip_blocks + trim_blocks
  CHECK(render("a  {{- 'b' -}}  \n c") == "abc");
  CHECK(render("x {%+ if true %}y{% endif +%}\nz") == "x y\nz");
  CHECK(render("{# a comment #}\nA") == "A");
  CHECK(render("a\n") == "a");  // one trailing newline goes
  CHECK(render("a\n\n") == "a\n");
  CHECK(render("a\r\nb") == "a\nb");
  CHECK(render("{{ 'x' }}\n") == "x");  // no trim after an expression, but the template's last newline goes
  CHECK(render("{{ 'x' }}\ny") == "x\ny");
}

TEST_CASE("jinja: Python values and operators") {
  CHECK(render("{{ 7 // 2 }} {{ -7 // 2 }} {{ -7 % 3 }} {{ 7 / 2 }} {{ 2 ** 10 }} {{ 1.0 }} {{ 3 * 'ab' }}") ==
        "3 -4 2 3.5 1024 1.0 ababab");
  CHECK(render("{{ 'a' ~ 1 ~ none ~ true ~ undefined_name }}") == "a1NoneTrue");
  CHECK(render("{{ [1, 'a', none] }} {{ {'k': 'v'} }}") == "[1, 'a', None] {'k': 'v'}");
  CHECK(render("{{ 'h\u00e9llo'[1:3] }} {{ [1, 2, 3][::-1] }} {{ 'abc'[-1] }} {{ [1][5] }}") == "\u00e9l [3, 2, 1] c ");
  CHECK(render("{{ 1 < 2 < 3 }} {{ 'b' in 'abc' }} {{ 2 not in [1] }} {{ 1 == 1.0 }} {{ true == 1 }}") ==
        "True True True True True");
  CHECK(render("{{ 'yes' if 0 else 'no' }}{{ 'x' if false }}|{{ 0 or 'b' }} {{ 'a' and 'b' }}") == "no|b b");
  CHECK(render("{{ x is defined }} {{ none is none }} {{ 'a' is string }} {{ 3 is odd }} {{ 9 is divisibleby 3 }}") ==
        "False True True True True");
  CHECK(render("{{ strftime_now is defined }} {{ raise_exception is not defined }}") == "True False");
}

TEST_CASE("jinja: strings, filters and methods") {
  CHECK(render("{{ ' x\u3000'.strip() }}|{{ '\u00a0x ' | trim }}|{{ 'xxay'.lstrip('x') }}|{{ 'a,b,,c'.split(',') }}") ==
        "x|x|ay|['a', 'b', '', 'c']");
  CHECK(render("{{ 'Hello World'.lower() }} {{ 'hi there' | title }} {{ 'ab'.upper() }} {{ 'aXa'.replace('a', 'b') }}") ==
        "hello world Hi There AB bXb");
  CHECK(render("{{ 'abc'.startswith('ab') }} {{ 'abc'.endswith(('x', 'c')) }} {{ ', '.join(['a', 'b']) }}") ==
        "True True a, b");
  CHECK(render("{{ [3, 1] | length }} {{ 'h\u00e9' | length }} {{ [1, 2] | first }} {{ [1, 2] | last }} {{ [1, 2] | "
               "join('-') }}") == "2 2 1 2 1-2");
  CHECK(render("{{ x | default('d') }} {{ '' | default('d', true) }} {{ '12' | int + 1 }} {{ 'z' | int }}") ==
        "d d 13 0");
  CHECK(render("{{ {'a': [1, 'x\u00e9\n\"'], 'b': none} | tojson }}") == "{\"a\": [1, \"x\u00e9\\n\\\"\"], \"b\": null}");
  CHECK(render("{{ {'a': 1} | tojson(indent=2) }}") == "{\n  \"a\": 1\n}");
  const Value people = Value::list({Value::dict({{"role", "user"}, {"n", 1}}), Value::dict({{"role", "tool"}, {"n", 2}}),
                                    Value::dict({{"role", "user"}, {"n", 3}})});
  CHECK(render("{{ people | selectattr('role', 'equalto', 'user') | map(attribute='n') | list }} "
               "{{ people | rejectattr('role', 'equalto', 'user') | length }}",
               Value::dict({{"people", people}})) == "[1, 3] 1");
  CHECK(render("{% set d = {'a': 1} %}{{ d.get('a') }} {{ d.get('b', 2) }} {{ d.keys() | list }}{% for k, v in "
               "d.items() %} {{ k }}={{ v }}{% endfor %}") == "1 2 ['a'] a=1");
}

TEST_CASE("jinja: errors say what and where") {
  auto raised = Template::parse("{{ raise_exception('no system role') }}")->render(Value::dict());
  CHECK(raised.status().code() == StatusCode::kFailedPrecondition);
  CHECK(raised.status().message() == "no system role");

  auto undefined = Template::parse("a\n{{ y.z }}")->render(Value::dict());
  CHECK(undefined.status().code() == StatusCode::kInvalidArgument);
  CHECK_THAT(undefined.status().message(), Catch::Contains("line 2") && Catch::Contains("'y' is undefined"));
  auto type = Template::parse("{{ 'a' + 1 }}")->render(Value::dict());
  CHECK_THAT(type.status().message(), Catch::Contains("unsupported operand types for +: 'str' and 'int'"));

  for (const char* bad : {"{% macro m() %}{% endmacro %}", "{{ x | wordcount }}", "{{ x.format() }}",
                          "{{ cycler() }}", "{% raw %}{% endraw %}", "{% set x %}y{% endset %}"}) {
    auto t = Template::parse(bad);
    INFO(bad);
    REQUIRE_FALSE(t.ok());
    CHECK(t.status().code() == StatusCode::kUnimplemented);
    CHECK_THAT(t.status().message(), Catch::Contains("line 1") && Catch::Contains("which baton does not render"));
  }
  for (const char* bad : {"{% if x %}", "{% endif %}", "{{ 'open }}", "{{ x", "{% for x %}{% endfor %}", "{{ (1 }}",
                          "{% if x %}{% else %}{% elif y %}{% endif %}", "{{ 1 2 }}"}) {
    auto t = Template::parse(bad);
    INFO(bad);
    REQUIRE_FALSE(t.ok());
    CHECK(t.status().code() == StatusCode::kInvalidArgument);
  }
}
