"""Structured output (response_format) and tools on the real model, checked by Python's `jsonschema`.

`baton local` on SmolLM2 (its 49,152-token byte-level vocabulary):
  * 200 random schemas from the supported subset (objects with required and optional properties,
    strings with length bounds, integers, numbers, booleans, null, enums, consts, arrays with item
    bounds, anyOf, $ref into $defs), each with a random prompt, sampled at temperature 1 through
    the official client: every output parses and validates;
  * greedy output under a schema equals the unconstrained greedy output wherever the latter
    already conforms (the schema is made from that output, so that it does);
  * streamed chunks, the gRPC API's response_format (and batonctl's --json-schema), and refusals
    that name the keyword;
  * tools with the official client, a full round trip: a forced call (tool_choice required, then
    a named function, streamed) whose arguments validate against the function's parameters, the
    tool's result sent back, and the answer.
"""

from __future__ import annotations

import json
import random
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import jsonschema
import openai
import pytest

from serving_harness import HTTP, Server, client, real_model_path

WORDS = ["river", "engine", "violet", "seven", "garden", "orbit", "copper", "lantern", "north", "maple", "quiet",
         "harbor", "signal", "pepper", "atlas", "winter", "canvas", "ember", "tunnel", "velvet"]


@pytest.fixture(scope="module")
def real_api(baton_bin):
    model = real_model_path()
    # f32: greedy equality below compares two runs of a prompt, the second one's prefill partly from
    # the prefix cache; in bf16 (where the CPU has it) that shifts logits enough to flip near-ties.
    s = Server(baton_bin, model, "--max-batch", "16", "--dtype", "f32", *HTTP)
    s.model = model
    yield s
    s.stop_clean()


def random_schema(rng, depth, defs):
    """A schema from the subset; small bounds everywhere, so that every sampled document ends."""
    kinds = 7 if depth <= 0 else 11
    k = rng.randrange(kinds)
    if k == 0:
        s = {"type": "string", "maxLength": rng.randrange(1, 10)}
        if rng.random() < 0.3:
            s["minLength"] = rng.randrange(0, s["maxLength"] + 1)
        return s
    if k == 1:
        return {"type": "integer"}
    if k == 2:
        return {"type": "number"}
    if k == 3:
        return {"type": "boolean"}
    if k == 4:
        return {"type": "null"} if rng.random() < 0.5 else {"type": ["string", "null"], "maxLength": 6}
    if k == 5:
        return {"enum": [rng.choice([rng.choice(WORDS), rng.randrange(-50, 50), None, True])
                         for _ in range(rng.randrange(1, 5))]}
    if k == 6:
        return {"const": rng.choice([rng.choice(WORDS), rng.randrange(100), {"unit": rng.choice(WORDS)}])}
    if k == 7:
        names = rng.sample(WORDS, rng.randrange(1, 5))
        props = {n: random_schema(rng, depth - 1, defs) for n in names}
        return {"type": "object", "properties": props, "required": [n for n in names if rng.random() < 0.6],
                "additionalProperties": False}
    if k == 8:
        s = {"type": "array", "items": random_schema(rng, depth - 1, defs), "maxItems": rng.randrange(1, 4)}
        if rng.random() < 0.5:
            s["minItems"] = rng.randrange(0, s["maxItems"] + 1)
        return s
    if k == 9:
        return {"anyOf": [random_schema(rng, depth - 1, defs), random_schema(rng, depth - 1, defs)]}
    name = f"d{len(defs)}"
    defs[name] = None  # taken before the body, which may add definitions of its own
    defs[name] = random_schema(rng, depth - 1, defs)
    return {"$ref": f"#/$defs/{name}"}


def random_document_schema(rng):
    defs = {}
    # The document is an object (what clients ask for), its members anything from the subset.
    names = rng.sample(WORDS, rng.randrange(1, 4))
    props = {n: random_schema(rng, 2, defs) for n in names}
    s = {"type": "object", "properties": props, "required": [n for n in names if rng.random() < 0.7],
         "additionalProperties": False}
    if defs:
        s["$defs"] = defs
    return s


def response_format(schema):
    return {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema, "strict": True}}


def test_random_schemas_sampled_at_temperature_1_parse_and_validate(real_api):
    seed = random.randrange(1 << 30)
    rng = random.Random(seed)
    c = client(real_api, timeout=600)
    cases = []
    for _ in range(200):
        schema = random_document_schema(rng)
        prompt = f"Answer in JSON about: {' '.join(rng.sample(WORDS, 3))}."
        cases.append((schema, prompt, rng.randrange(1 << 31)))

    def run(case):
        schema, prompt, s = case
        r = c.chat.completions.create(model=real_api.model.stem, messages=[{"role": "user", "content": prompt}],
                                      response_format=response_format(schema), temperature=1.0, seed=s,
                                      max_tokens=600)
        return r.choices[0].message.content, r.choices[0].finish_reason, r.usage.completion_tokens

    with ThreadPoolExecutor(16) as pool:
        results = list(pool.map(run, cases))
    longest = 0
    for (schema, prompt, s), (text, finish, n_tokens) in zip(cases, results):
        where = f"test seed {seed}, schema {json.dumps(schema)}, request seed {s}: {text!r}"
        assert finish == "stop", where
        value = json.loads(text)  # raises on anything that is not one JSON document
        jsonschema.validate(value, schema)
        longest = max(longest, n_tokens)
    print(f"200 schemas: longest output {longest} tokens")


def schema_of(value):
    """A schema the value conforms to, with the object's members in the value's own order."""
    if isinstance(value, bool):
        return {"type": "boolean"}
    if isinstance(value, int):
        return {"type": "integer"}
    if isinstance(value, float):
        return {"type": "number"}
    if isinstance(value, str):
        return {"type": "string"}
    if value is None:
        return {"type": "null"}
    if isinstance(value, list):
        return {"type": "array", "items": schema_of(value[0]) if value else {}}
    return {"type": "object", "properties": {k: schema_of(v) for k, v in value.items()}, "required": list(value),
            "additionalProperties": False}


def test_greedy_under_a_schema_equals_unconstrained_greedy_where_that_conforms(real_api):
    c = client(real_api, timeout=300)
    prompts = ["Give me a person as JSON with name, age and city.", "Return a JSON object describing a book.",
               "Output a JSON object with the keys x and y, both numbers.", "Describe a car in JSON.",
               "Give a JSON object of three colours and their hex codes.", "A JSON object with a list of 3 fruits."]
    conforming = 0
    for p in prompts:
        messages = [{"role": "user", "content": p}]
        free = c.chat.completions.create(model=real_api.model.stem, messages=messages, temperature=0, max_tokens=120)
        text = free.choices[0].message.content
        if free.choices[0].finish_reason != "stop":
            continue
        try:
            value = json.loads(text)
        except json.JSONDecodeError:
            continue
        if not isinstance(value, dict):
            continue
        conforming += 1
        for schema_fmt in (response_format(schema_of(value)), {"type": "json_object"}):
            got = c.chat.completions.create(model=real_api.model.stem, messages=messages, temperature=0,
                                            max_tokens=120, response_format=schema_fmt)
            assert got.choices[0].message.content == text, (p, schema_fmt)
        # And where it does not conform, the constrained output differs and validates.
        other = {"type": "object", "properties": {"zzz_unlikely": {"enum": [1, 2]}}, "required": ["zzz_unlikely"],
                 "additionalProperties": False}
        got = c.chat.completions.create(model=real_api.model.stem, messages=messages, temperature=0, max_tokens=120,
                                        response_format=response_format(other))
        assert got.choices[0].message.content != text
        jsonschema.validate(json.loads(got.choices[0].message.content), other)
    assert conforming >= 1, "no prompt gave unconstrained JSON: the comparison never ran"


def test_streamed_chunks_join_into_a_valid_document(real_api):
    c = client(real_api, timeout=300)
    schema = {"type": "object", "properties": {"title": {"type": "string", "maxLength": 30},
                                               "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]},
                                                        "minItems": 1, "maxItems": 3},
                                               "year": {"type": "integer"}},
              "required": ["title", "tags", "year"], "additionalProperties": False}
    chunks = c.chat.completions.create(model=real_api.model.stem, stream=True, temperature=0.8, seed=7,
                                       messages=[{"role": "user", "content": "A film, as JSON."}],
                                       response_format=response_format(schema), max_tokens=200)
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    jsonschema.validate(json.loads(text), schema)


def test_grpc_response_format_and_refusals(real_api, pb, batonctl, tmp_path):
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer"}},
              "required": ["ok", "n"], "additionalProperties": False}
    req = pb.gen.GenerateRequest(prompt="The answer, as JSON:", max_tokens=60)
    req.sampling.CopyFrom(pb.gen.SamplingParams(temperature=1.0, seed=3, response_format=pb.gen.ResponseFormat(
        type=pb.gen.ResponseFormat.JSON_SCHEMA, json_schema=json.dumps(schema))))
    with grpc.insecure_channel(real_api.address) as ch:
        stub = pb.gen_grpc.GenerationStub(ch)
        msgs = list(stub.Generate(req, timeout=120))
        text = "".join(m.text for m in msgs)
        jsonschema.validate(json.loads(text), schema)
        bad = pb.gen.GenerateRequest(prompt="x", max_tokens=4)
        bad.sampling.CopyFrom(pb.gen.SamplingParams(response_format=pb.gen.ResponseFormat(
            type=pb.gen.ResponseFormat.JSON_SCHEMA, json_schema='{"type": "string", "pattern": "^a"}')))
        with pytest.raises(grpc.RpcError) as e:
            list(stub.Generate(bad, timeout=30))
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "'pattern'" in e.value.details()

    # batonctl generate --json-schema: the same through the CLI.
    schema_file = tmp_path / "schema.json"
    schema_file.write_text(json.dumps(schema))
    out = subprocess.run([str(batonctl), "generate", "--address", real_api.address, "--prompt", "The answer, as JSON:",
                          "--max-tokens", "60", "--temperature", "1", "--seed", "5", "--json-schema", str(schema_file)],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    jsonschema.validate(json.loads(out.stdout), schema)
    bad_file = tmp_path / "bad.json"
    bad_file.write_text('{"type": "integer", "minimum": 3}')
    out = subprocess.run([str(batonctl), "generate", "--address", real_api.address, "--prompt", "x",
                          "--json-schema", str(bad_file)], capture_output=True, text=True, timeout=60)
    assert out.returncode != 0 and "'minimum'" in out.stderr

    c = client(real_api)
    for fmt, says in [(response_format({"type": "object", "properties": {"a": {"type": "number", "minimum": 0}}}),
                       "'minimum' (at /properties/a)"),
                      (response_format({"oneOf": [{"type": "string"}]}), "'oneOf'"),
                      ({"type": "yaml"}, "text, json_object or json_schema")]:
        with pytest.raises(openai.BadRequestError) as e:
            c.chat.completions.create(model=real_api.model.stem, messages=[{"role": "user", "content": "x"}],
                                      response_format=fmt, max_tokens=4)
        assert says in e.value.message and e.value.body["param"] == "response_format"


TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 40},
                                                    "unit": {"enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}},
    {"type": "function", "function": {"name": "get_time", "description": "The time in a timezone",
                                      "parameters": {"type": "object", "properties": {"tz": {"type": "string", "maxLength": 30}},
                                                     "required": ["tz"]}}}]


@pytest.fixture(scope="module")
def mistral_api(baton_bin, tmp_path_factory):
    """SmolLM2 behind Mistral v0.3's own chat template (tests/e2e/chat_templates.json): calls are
    written "[TOOL_CALLS] [...]", and the template refuses call ids that are not 9 letters and digits."""
    model = real_model_path()
    templates = json.loads((Path(__file__).resolve().parents[1] / "e2e" / "chat_templates.json").read_text())
    path = tmp_path_factory.mktemp("mistral") / "mistral-v0.3.jinja"
    path.write_text(templates["mistralai/Mistral-7B-Instruct-v0.3"]["template"])
    s = Server(baton_bin, model, "--chat-template", str(path), *HTTP)
    s.model = model
    yield s
    s.stop_clean()


@pytest.mark.parametrize("template", ["model", "mistral"])
def test_tool_call_round_trip_with_the_official_client(template, request):
    """With the model's own template (Hermes-style <tool_call> tags) and with Mistral's."""
    api = request.getfixturevalue("real_api" if template == "model" else "mistral_api")
    c = client(api, timeout=300)
    model = api.model.stem
    messages = [{"role": "user", "content": "What is the weather in Paris right now?"}]
    r = c.chat.completions.create(model=model, messages=messages, tools=TOOLS, tool_choice="required",
                                  temperature=0.7, seed=11, max_tokens=120)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.type == "function"
    assert call.id.startswith("call_") if template == "model" else (len(call.id) == 9 and call.id.isalnum())
    schema = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}[call.function.name]
    jsonschema.validate(json.loads(call.function.arguments), schema)

    # The call and its result go back; the model answers in text (tool_choice auto).
    messages.append(choice.message.model_dump(exclude_none=True))
    messages.append({"role": "tool", "tool_call_id": call.id, "content": json.dumps({"temperature": 18, "sky": "clear"})})
    answer = c.chat.completions.create(model=model, messages=messages, tools=TOOLS, temperature=0, max_tokens=40)
    assert answer.choices[0].finish_reason in ("stop", "length")
    assert not answer.choices[0].message.tool_calls
    # The history went through the template (Mistral's would refuse an id of another shape), call
    # and result included. SmolLM2 answers in text after its own template; after Mistral's, which
    # ends on the result with no turn marker, it may well end at once.
    assert answer.usage.prompt_tokens > r.usage.prompt_tokens + len(call.function.arguments) // 4
    if template == "model":
        assert answer.choices[0].message.content

    # A named function, streamed: the call arrives as a tool_calls delta, then finish_reason tool_calls.
    chunks = list(c.chat.completions.create(model=model, messages=messages[:1], tools=TOOLS, stream=True,
                                            tool_choice={"type": "function", "function": {"name": "get_time"}},
                                            temperature=0, max_tokens=200))
    deltas = [d for ch in chunks if ch.choices for d in (ch.choices[0].delta.tool_calls or [])]
    assert len(deltas) == 1 and deltas[0].index == 0 and deltas[0].function.name == "get_time"
    jsonschema.validate(json.loads(deltas[0].function.arguments), TOOLS[1]["function"]["parameters"])
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == "tool_calls"
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == ""


def test_tool_refusals_name_the_field(real_api):
    c = client(real_api)
    base = {"model": real_api.model.stem, "messages": [{"role": "user", "content": "x"}], "max_tokens": 4}
    for extra, param, says in [
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice",
         "not in tools"),
        ({"tool_choice": "required"}, "tool_choice", "needs tools"),
        ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools", "letters, digits"),
        ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "response_format",
         "cannot both"),
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
            "d": {"type": "string", "format": "date"}}}}}], "tool_choice": "required"}, "tools", "'format'"),
    ]:
        with pytest.raises(openai.BadRequestError) as e:
            c.chat.completions.create(**base, **extra)
        assert says in e.value.message, (extra, e.value.message)
        assert e.value.body["param"] == param, (extra, e.value.body)
