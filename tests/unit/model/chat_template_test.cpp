// Chat templates through the Jinja engine. The expected strings were produced by transformers'
// apply_chat_template(messages, tokenize=False, add_generation_prompt=...) on SmolLM2's template
// (from its GGUF) and on Llama 3.0's; tests/e2e/test_chat_templates.py compares every family's
// template with transformers on random conversations each run.
#include "model/chat_template.h"

#include <catch2/catch.hpp>
#include <filesystem>
#include <fstream>
#include <random>
#include <string>
#include <vector>


using namespace baton;

namespace {

const std::string kSmolTemplate =
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}{{ '<|im_start|>system\n"
    "You are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}{% endif %}{{'<|im_start|>'"
    " + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt "
    "%}{{ '<|im_start|>assistant\n' }}{% endif %}";
const std::vector<ChatMessage> kUserOnly = {{"user", "Hello!"}};
const std::vector<ChatMessage> kWithSystem = {
    {"system", "Be brief."}, {"user", "Hi"}, {"assistant", "Hello."}, {"user", "2+2?"}};
const std::vector<ChatMessage> kSpaced = {
    {"user", "  spaced\n"}, {"assistant", "ok"}, {"user", "\u3000again\u2028\x1c"}};

}  // namespace

TEST_CASE("ChatML renders as HF does, with SmolLM2's default system prompt") {
  auto tmpl = ChatTemplate::from_jinja(kSmolTemplate, "model", {"", "<|im_end|>"});
  REQUIRE(tmpl.ok());
  CHECK(tmpl->name() == "model");
  CHECK(tmpl->render(kUserOnly, true).value() ==
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
        "<|im_start|>user\nHello!<|im_end|>\n<|im_start|>assistant\n");
  CHECK(tmpl->render(kWithSystem, false).value() ==
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\nHello."
        "<|im_end|>\n<|im_start|>user\n2+2?<|im_end|>\n");
  CHECK(tmpl->render(kSpaced, true).value() ==
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
        "<|im_start|>user\n  spaced\n<|im_end|>\n<|im_start|>assistant\nok<|im_end|>\n<|im_start|>user\n"
        "\u3000again\u2028\x1c<|im_end|>\n<|im_start|>assistant\n");
  // --chat-template chatml: the format alone, no default system turn.
  CHECK(ChatTemplate::builtin("chatml", {})->render(kUserOnly, true).value() ==
        "<|im_start|>user\nHello!<|im_end|>\n<|im_start|>assistant\n");
}

TEST_CASE("Llama 3 renders as HF does, BOS text first and contents trimmed") {
  auto tmpl = ChatTemplate::builtin("llama3", {"<|begin_of_text|>", "<|eot_id|>"});
  REQUIRE(tmpl.ok());
  CHECK(tmpl->name() == "llama3");
  CHECK(tmpl->render(kUserOnly, true).value() ==
        "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nHello!<|eot_id|><|start_header_id|>assistant"
        "<|end_header_id|>\n\n");
  CHECK(tmpl->render(kSpaced, false).value() ==
        "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nspaced<|eot_id|><|start_header_id|>assistant"
        "<|end_header_id|>\n\nok<|eot_id|><|start_header_id|>user<|end_header_id|>\n\nagain<|eot_id|>");
}

TEST_CASE("a template's refusal is an INVALID_ARGUMENT in its own words") {
  for (const char* name : {"llama2", "mistral"}) {
    auto tmpl = ChatTemplate::builtin(name, {"<s>", "</s>"});
    REQUIRE(tmpl.ok());
    const std::vector<ChatMessage> twice = {{"user", "a"}, {"user", "b"}};
    auto r = tmpl->render(twice, true);
    CHECK(r.status().code() == StatusCode::kInvalidArgument);
    CHECK_THAT(r.status().message(), Catch::Contains("refuses these messages") && Catch::Contains("must alternate"));
  }
  auto empty = ChatTemplate::builtin("chatml", {})->render({}, true);
  CHECK(empty.status().code() == StatusCode::kInvalidArgument);
  // A system turn is part of Llama 2's first [INST].
  auto llama2 = ChatTemplate::builtin("llama2", {"<s>", "</s>"});
  CHECK(llama2->render(kWithSystem, true).value() ==
        "<s>[INST] <<SYS>>\nBe brief.\n<</SYS>>\n\nHi [/INST] Hello. </s><s>[INST] 2+2? [/INST]");
}

TEST_CASE("templates baton cannot use are refused at load, naming --chat-template") {
  auto unknown = ChatTemplate::builtin("vicuna", {});
  CHECK(unknown.status().code() == StatusCode::kInvalidArgument);
  CHECK_THAT(unknown.status().message(), Catch::Contains("vicuna") && Catch::Contains("llama2") &&
                                             Catch::Contains("zephyr"));
  auto macro = ChatTemplate::from_jinja("{% macro f() %}{% endmacro %}", "model", {});
  CHECK(macro.status().code() == StatusCode::kUnimplemented);
  CHECK_THAT(macro.status().message(), Catch::Contains("the model's chat template") &&
                                           Catch::Contains("--chat-template"));
  // Parses, but cannot render the simplest chat: refused at load too, not at the first request.
  auto broken = ChatTemplate::from_jinja("{{ messages[1]['content'] }}", "model", {});
  CHECK(broken.status().code() == StatusCode::kInvalidArgument);
  CHECK_THAT(broken.status().message(), Catch::Contains("cannot render a one-message chat"));
}

TEST_CASE("the chat-template flag reads a Jinja file, and takes anything else as a built-in name") {
  const auto path = std::filesystem::temp_directory_path() / ("baton_template_" + std::to_string(std::random_device()()) + ".jinja");
  std::ofstream(path) << "{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}\n";
  auto from_file = ChatTemplate::from_flag(path.string(), {});
  std::filesystem::remove(path);
  REQUIRE(from_file.ok());
  CHECK(from_file->name() == path.string());
  CHECK(from_file->render(kUserOnly, true).value() == "[user] Hello!\n");
  CHECK(ChatTemplate::from_flag("zephyr", {"", "</s>"})->render(kUserOnly, true).value() ==
        "<|user|>\nHello!</s>\n<|assistant|>\n");
  CHECK(ChatTemplate::from_flag("/no/such/file.jinja", {}).status().code() == StatusCode::kInvalidArgument);
}
