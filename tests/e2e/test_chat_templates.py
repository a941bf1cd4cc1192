"""Chat templates rendered by baton's Jinja engine against transformers' apply_chat_template.

The oracle is transformers itself (no torch needed): apply_chat_template(messages,
chat_template=T, tokenize=False, add_generation_prompt=G) on a tokenizer whose bos/eos are set,
and jinja2 underneath it. The templates are the ones the model families ship
(chat_templates.json: Llama 2, Llama 3.0/3.1/3.2, Mistral v0.1 (2023 and current)/v0.2/v0.3,
Zephyr, TinyLlama, Qwen2, Qwen2.5) plus SmolLM2's from its GGUF. Conversations are drawn fresh
each run (BATON_TEMPLATE_SEED replays one): with and without a system prompt, one to five turns,
with and without the generation prompt, contents with white-space runs, CJK, emoji, quotes,
backslashes and Jinja-looking text, and some with roles that do not alternate, which the
Llama 2 and Mistral templates refuse: baton must refuse exactly those (and say the template's
words), and render every other one to the same text.
"""

from __future__ import annotations

import json
import os
import random
import string
import subprocess
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
TEMPLATES = json.loads((HERE / "chat_templates.json").read_text())
BUILTINS = {  # baton's --chat-template names and the model whose template each one is
    "llama2": "meta-llama/Llama-2-7b-chat-hf",
    "llama3": "meta-llama/Meta-Llama-3-8B-Instruct",
    "mistral": "mistralai/Mistral-7B-Instruct-v0.2",
    "zephyr": "HuggingFaceH4/zephyr-7b-beta",
}
CHATML = ("{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + "
          "'<|im_end|>' + '\\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
PIECES = ["Hello", " world ", "\n\n", "  leading", "trailing  ", "\t", "日本語のテキスト", "🙂🚀", "{{ not code }}",
          "{% if x %}", "a\\b", "'quotes' \"double\"", "<|im_start|>", "[INST]", " ", "\u00a0nbsp\u3000", "1234567890",
          "\u001c", "Ünïcödé"]

SEED = int(os.environ.get("BATON_TEMPLATE_SEED", random.SystemRandom().randrange(2**32)))


def conversations(seed: int, n: int = 48) -> list[dict]:
    rng = random.Random(seed)

    def content() -> str:
        return "".join(rng.choice(PIECES) for _ in range(rng.randint(0, 5))) + rng.choice(["", "x" * rng.randint(1, 80)])

    out = [{"messages": [{"role": "user", "content": "Hi"}], "add_generation_prompt": True}]
    for _ in range(n):
        msgs = [{"role": "system", "content": content()}] if rng.random() < 0.5 else []
        for i in range(rng.randint(1, 5)):
            msgs.append({"role": "user" if i % 2 == 0 else "assistant", "content": content()})
        if rng.random() < 0.15:  # roles that do not alternate
            msgs.append(dict(msgs[-1]))
        out.append({"messages": msgs, "add_generation_prompt": rng.random() < 0.7})
    return out


@pytest.fixture(scope="module")
def hf_tokenizer():
    from tokenizers import Tokenizer
    from tokenizers.models import BPE
    from transformers import PreTrainedTokenizerFast
    return PreTrainedTokenizerFast(tokenizer_object=Tokenizer(BPE()), bos_token="<s>", eos_token="</s>")


def transformers_render(tok, template: str, conv: dict) -> dict:
    import jinja2
    try:
        return {"text": tok.apply_chat_template(conv["messages"], chat_template=template, tokenize=False,
                                                add_generation_prompt=conv["add_generation_prompt"])}
    except jinja2.exceptions.TemplateError as e:  # the template's raise_exception()
        return {"error": str(e)}


def baton_render(baton_bin: str, tmp_path: Path, convs: list[dict], *flags: str) -> list[dict]:
    path = tmp_path / "conversations.json"
    path.write_text(json.dumps(convs))
    p = subprocess.run([baton_bin, "chat-template", *flags, "--conversations", str(path)],
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    lines = [json.loads(line) for line in p.stdout.splitlines()]
    assert len(lines) == len(convs)
    return lines


def check_equal(template_name: str, convs: list[dict], got: list[dict], want: list[dict]) -> int:
    refused = 0
    for conv, g, w in zip(convs, got, want):
        where = f"{template_name}, seed {SEED}: {json.dumps(conv, ensure_ascii=False)[:400]}"
        if "error" in w:
            assert "error" in g, f"transformers refused ({w['error']}) and baton rendered: {where}"
            assert w["error"] in g["error"], where
            refused += 1
        else:
            assert "text" in g, f"baton refused ({g['error']}): {where}"
            assert g["text"] == w["text"], where
    return refused


@pytest.mark.parametrize("model", sorted(TEMPLATES))
def test_model_templates_render_as_transformers(model, baton_bin, hf_tokenizer, tmp_path):
    template = TEMPLATES[model]["template"]
    (tmp_path / "t.jinja").write_text(template)
    convs = conversations(SEED + sorted(TEMPLATES).index(model))
    got = baton_render(baton_bin, tmp_path, convs, "--chat-template", str(tmp_path / "t.jinja"),
                       "--bos-token", "<s>", "--eos-token", "</s>")
    refused = check_equal(model, convs, got, [transformers_render(hf_tokenizer, template, c) for c in convs])
    print(f"{model}: {len(convs)} conversations equal to transformers ({refused} refused by both)")


TOOL_TEMPLATES = ["meta-llama/Llama-3.1-8B-Instruct", "meta-llama/Llama-3.2-1B-Instruct", "Qwen/Qwen2.5-0.5B-Instruct",
                  "mistralai/Mistral-7B-Instruct-v0.3"]


def tool_conversations(seed: int, n: int = 24) -> tuple[list[dict], list[dict]]:
    """Conversations with OpenAI tools: (baton's form, transformers' form). OpenAI sends a call's
    arguments as JSON text; transformers' templates take a mapping."""
    rng = random.Random(seed)
    ours, theirs = [], []
    for _ in range(n):
        tools = []
        for k in range(rng.randint(1, 3)):
            props = {f"p{j}": rng.choice([{"type": "string", "description": "a name"}, {"type": "integer"},
                                          {"type": "string", "enum": ["a", "b"]}]) for j in range(rng.randint(0, 3))}
            tools.append({"type": "function", "function": {
                "name": f"fn_{k}_{rng.choice(PIECES[:2]).strip().lower() or 'x'}", "description": rng.choice(PIECES),
                "parameters": {"type": "object", "properties": props, "required": list(props)[:1]}}})
        msgs = [{"role": "user", "content": rng.choice(PIECES)}]
        if rng.random() < 0.7:
            name = tools[0]["function"]["name"]
            args = {f"p{j}": rng.choice(["x", 3, "b"]) for j in range(rng.randint(0, 2))}
            msgs.append({"role": "assistant", "content": "",
                         # 9 letters and digits: the only ids Mistral's template takes (baton gives
                         # its calls such ids for that template: server/openai_json.h)
                         "tool_calls": [{"id": "".join(rng.choice(string.ascii_letters + string.digits)
                                                       for _ in range(9)), "type": "function",
                                         "function": {"name": name, "arguments": args}}]})
            msgs.append({"role": "tool", "tool_call_id": msgs[-1]["tool_calls"][0]["id"], "content": rng.choice(PIECES)})
        gen = rng.random() < 0.8
        theirs.append({"messages": msgs, "tools": tools, "add_generation_prompt": gen})
        ours_msgs = json.loads(json.dumps(msgs))
        for m in ours_msgs:
            for c in m.get("tool_calls", []):
                c["function"]["arguments"] = json.dumps(c["function"]["arguments"])
        ours.append({"messages": ours_msgs, "tools": tools, "add_generation_prompt": gen})
    return ours, theirs


@pytest.mark.parametrize("model", TOOL_TEMPLATES)
def test_tools_render_as_transformers_renders_them(model, baton_bin, hf_tokenizer, tmp_path):
    """apply_chat_template(tools=...) with the families' tool-aware templates: the tools, an
    assistant's calls (arguments sent as text, as OpenAI sends them) and tool results."""
    template = TEMPLATES[model]["template"]
    (tmp_path / "t.jinja").write_text(template)
    ours, theirs = tool_conversations(SEED + TOOL_TEMPLATES.index(model))
    got = baton_render(baton_bin, tmp_path, ours, "--chat-template", str(tmp_path / "t.jinja"),
                       "--bos-token", "<s>", "--eos-token", "</s>")
    want = []
    for c in theirs:
        import jinja2
        try:
            want.append({"text": hf_tokenizer.apply_chat_template(c["messages"], tools=c["tools"], chat_template=template,
                                                                  tokenize=False,
                                                                  add_generation_prompt=c["add_generation_prompt"])})
        except jinja2.exceptions.TemplateError as e:
            want.append({"error": str(e)})
    check_equal(model, ours, got, want)
    assert sum("text" in w for w in want) >= len(want) // 2


@pytest.mark.parametrize("name", ["chatml", *BUILTINS])
def test_builtin_templates_are_the_families_own(name, baton_bin, hf_tokenizer, tmp_path):
    template = CHATML if name == "chatml" else TEMPLATES[BUILTINS[name]]["template"]
    convs = conversations(SEED + 101)
    got = baton_render(baton_bin, tmp_path, convs, "--chat-template", name, "--bos-token", "<s>", "--eos-token", "</s>")
    check_equal(name, convs, got, [transformers_render(hf_tokenizer, template, c) for c in convs])


def test_the_gguf_template_with_its_special_tokens(baton_bin, model_path, tmp_path):
    """SmolLM2's own template (its default system prompt) with the GGUF's bos/eos text."""
    import gguf
    from transformers import PreTrainedTokenizerFast
    from tokenizers import Tokenizer
    from tokenizers.models import BPE
    reader = gguf.GGUFReader(model_path)

    def field(key):
        f = reader.fields[key]
        return f.contents()

    tokens = field("tokenizer.ggml.tokens")
    tok = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(BPE()),
                                  bos_token=tokens[field("tokenizer.ggml.bos_token_id")],
                                  eos_token=tokens[field("tokenizer.ggml.eos_token_id")])
    template = field("tokenizer.chat_template")
    convs = conversations(SEED + 202, 24)
    got = baton_render(baton_bin, tmp_path, convs, "--model", model_path)
    check_equal("SmolLM2 GGUF", convs, got, [transformers_render(tok, template, c) for c in convs])
    assert "You are a helpful AI assistant named SmolLM" in got[0]["text"]  # its default system prompt


def run_baton(baton_bin, *args):
    return subprocess.run([baton_bin, *args], capture_output=True, text=True, timeout=60)


def test_one_conversation_prints_exactly_the_text(baton_bin, hf_tokenizer):
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "  Hi  "}]
    p = run_baton(baton_bin, "chat-template", "--chat-template", "llama2", "--bos-token", "<s>", "--eos-token", "</s>",
                  "--messages", json.dumps(msgs))
    assert p.returncode == 0, p.stderr
    want = transformers_render(hf_tokenizer, TEMPLATES[BUILTINS["llama2"]]["template"],
                               {"messages": msgs, "add_generation_prompt": True})
    assert p.stdout == want["text"]


@pytest.mark.parametrize("source, says", [
    ("{% macro m() %}x{% endmacro %}{{ m() }}", "line 1: uses the statement {% macro %}"),
    ("{% for m in messages %}\n{{ m.content | wordcount }}{% endfor %}", "line 2: uses the filter 'wordcount'"),
    ("{{ messages[0].content.format(1) }}", "the method 'format'"),
    ("{% if messages %}unclosed", "expected {% endif %}"),
    ("{{ messages[5]['content'] }}", "cannot render a one-message chat"),
])
def test_a_template_baton_cannot_render_is_refused_at_load(baton_bin, model_path, tmp_path, source, says):
    (tmp_path / "t.jinja").write_text(source)
    for flags in (["chat-template", "--chat-template", str(tmp_path / "t.jinja"), "--messages", "[]"],
                  ["generate", "--model", model_path, "--chat-template", str(tmp_path / "t.jinja"), "--chat", "Hi",
                   "--max-tokens", "1"]):
        p = run_baton(baton_bin, *flags)
        assert p.returncode != 0, p.stdout
        assert says in p.stderr and "--chat-template" in p.stderr, p.stderr


def test_bad_flags_are_refused(baton_bin, tmp_path):
    p = run_baton(baton_bin, "chat-template", "--chat-template", "vicuna", "--messages", "[]")
    assert p.returncode != 0 and "unknown template 'vicuna'" in p.stderr and "llama2" in p.stderr, p.stderr
    p = run_baton(baton_bin, "chat-template", "--chat-template", "chatml", "--messages", "{not json")
    assert p.returncode != 0 and "--messages is not valid JSON" in p.stderr, p.stderr
    p = run_baton(baton_bin, "chat-template", "--chat-template", "chatml", "--messages", '[{"role": "user"}]')
    assert p.returncode != 0 and "--messages[0]" in p.stderr, p.stderr
    p = run_baton(baton_bin, "chat-template", "--chat-template", "mistral", "--messages",
                  json.dumps([{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]))
    assert p.returncode != 0 and "refuses these messages" in p.stderr and "must alternate" in p.stderr, p.stderr


def test_served_chat_uses_the_template_and_its_refusals(baton_bin, model_path, tmp_path, hf_tokenizer, pb):
    """`baton local --chat-template mistral`: an OpenAI chat's prompt is the template's text
    (its token count equals the tokenized transformers rendering), and a conversation the
    template refuses is a 400 over HTTP and INVALID_ARGUMENT over gRPC, in the template's words."""
    import grpc
    import openai

    from serving_harness import Server

    srv = Server(Path(baton_bin), model_path, "--chat-template", "mistral", "--http-listen", "127.0.0.1:0")
    try:
        client = openai.OpenAI(base_url=f"{srv.http_url}/v1", api_key="unused")
        model = client.models.list().data[0]
        assert model.model_extra["baton"]["chat_template"] == "mistral"
        msgs = [{"role": "system", "content": "Answer in one word."}, {"role": "user", "content": "Capital of France?"}]
        r = client.chat.completions.create(model=model.id, messages=msgs, max_tokens=4, temperature=0)
        import gguf
        reader = gguf.GGUFReader(model_path)
        tokens = reader.fields["tokenizer.ggml.tokens"].contents()
        bos = reader.fields["tokenizer.ggml.bos_token_id"].contents()
        eos = reader.fields["tokenizer.ggml.eos_token_id"].contents()
        from tokenizers import Tokenizer
        from tokenizers.models import BPE
        from transformers import PreTrainedTokenizerFast
        tok = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(BPE()), bos_token=tokens[bos], eos_token=tokens[eos])
        template = TEMPLATES[BUILTINS["mistral"]]["template"]
        text = transformers_render(tok, template, {"messages": msgs, "add_generation_prompt": True})["text"]
        ids = run_baton(baton_bin, "tokenize", "--model", model_path, text)
        assert ids.returncode == 0, ids.stderr
        assert r.usage.prompt_tokens == len(ids.stdout.strip().split(","))

        twice = [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model=model.id, messages=twice, max_tokens=4)
        assert "must alternate" in str(e.value), e.value
        req = pb.gen.GenerateRequest(messages=[pb.gen.ChatMessage(role=m["role"], content=m["content"]) for m in twice],
                                     max_tokens=4)
        with grpc.insecure_channel(srv.address) as ch:
            with pytest.raises(grpc.RpcError) as e:
                list(pb.gen_grpc.GenerationStub(ch).Generate(req, timeout=60))
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "must alternate" in e.value.details()
    finally:
        srv.stop()


def test_a_server_does_not_start_with_a_template_it_cannot_render(baton_bin, model_path, tmp_path):
    (tmp_path / "t.jinja").write_text("{% macro m() %}{% endmacro %}")
    p = subprocess.run([baton_bin, "local", "--model", model_path, "--listen", "127.0.0.1:0",
                        "--chat-template", str(tmp_path / "t.jinja")], capture_output=True, text=True, timeout=120)
    assert p.returncode != 0
    assert "macro" in p.stdout + p.stderr and "--chat-template" in p.stdout + p.stderr, p.stdout + p.stderr
