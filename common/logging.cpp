#include "common/logging.h"

#include <spdlog/pattern_formatter.h>
#include <spdlog/spdlog.h>

#include <memory>

namespace baton {
namespace {

// %* in a pattern: the message as the body of a JSON string (quotes, backslashes and control
// characters escaped), so a message can never break the JSON line.
class JsonEscapedMessage final : public spdlog::custom_flag_formatter {
 public:
  void format(const spdlog::details::log_msg& msg, const std::tm&, spdlog::memory_buf_t& dest) override {
    for (char c : msg.payload) {
      switch (c) {
        case '"': append(dest, "\\\""); break;
        case '\\': append(dest, "\\\\"); break;
        case '\n': append(dest, "\\n"); break;
        case '\r': append(dest, "\\r"); break;
        case '\t': append(dest, "\\t"); break;
        default:
          if (static_cast<unsigned char>(c) < 0x20) {
            char buf[8];
            std::snprintf(buf, sizeof(buf), "\\u%04x", c);
            append(dest, buf);
          } else {
            dest.push_back(c);
          }
      }
    }
  }
  std::unique_ptr<custom_flag_formatter> clone() const override { return std::make_unique<JsonEscapedMessage>(); }

 private:
  static void append(spdlog::memory_buf_t& dest, const char* s) {
    while (*s != '\0') dest.push_back(*s++);
  }
};

}  // namespace

Status init_logging(const std::string& level, const std::string& format) {
  const auto lvl = spdlog::level::from_str(level);
  if (lvl == spdlog::level::off && level != "off") {
    return invalid_argument("--log-level must be trace, debug, info, warn or error, got '" + level + "'");
  }
  spdlog::set_level(lvl);
  if (format == "text") {
    spdlog::set_pattern("%Y-%m-%dT%H:%M:%S.%e %^%l%$ [%t] %v");
  } else if (format == "json") {
    auto f = std::make_unique<spdlog::pattern_formatter>(spdlog::pattern_time_type::utc);
    f->add_flag<JsonEscapedMessage>('*').set_pattern(
        R"({"time":"%Y-%m-%dT%H:%M:%S.%fZ","level":"%l","thread":%t,"msg":"%*"})");
    spdlog::set_formatter(std::move(f));
  } else {
    return invalid_argument("--log-format must be text or json, got '" + format + "'");
  }
  return {};
}

}  // namespace baton
