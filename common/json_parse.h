// Parsing request JSON into nlohmann::ordered_json (objects keep their members in the order they
// came: a schema's properties are generated in that order) in time linear in the text.
// ordered_json's own parser inserts each member by a linear search of the object's members (to
// replace a duplicate key), so an object of n members took O(n^2): 145 ms for 10,000 members,
// seconds for a 4 MiB body of such objects. Here each open object keeps a hash index of its keys
// instead (a duplicate key still replaces the earlier value: the last one wins, as nlohmann does).
// Depth and width are bounded before this runs (common/json_bounds.h); header-only, for the
// libraries that use nlohmann.
#pragma once

#include <nlohmann/json.hpp>

#include <string>
#include <string_view>
#include <unordered_map>
#include <utility>
#include <vector>

namespace baton {

namespace json_parse_internal {

// A SAX handler building an ordered_json with O(1) work per member.
class OrderedBuilder {
 public:
  using Json = nlohmann::ordered_json;

  explicit OrderedBuilder(Json* root) : root_(root) {}

  bool null() { return put(Json(nullptr)); }
  bool boolean(bool v) { return put(Json(v)); }
  bool number_integer(Json::number_integer_t v) { return put(Json(v)); }
  bool number_unsigned(Json::number_unsigned_t v) { return put(Json(v)); }
  bool number_float(Json::number_float_t v, const Json::string_t&) { return put(Json(v)); }
  bool string(Json::string_t& v) { return put(Json(std::move(v))); }
  bool binary(Json::binary_t& v) { return put(Json::binary(std::move(v))); }
  bool start_object(std::size_t) { return open(Json::object()); }
  bool start_array(std::size_t) { return open(Json::array()); }
  bool key(Json::string_t& k) {
    key_ = std::move(k);
    return true;
  }
  bool end_object() { return close(); }
  bool end_array() { return close(); }
  bool parse_error(std::size_t, const std::string&, const nlohmann::detail::exception& e) {
    error_ = e.what();
    return false;
  }

  const std::string& error() const { return error_; }

 private:
  struct Open {
    Json* value;
    std::unordered_map<std::string, size_t> index;  // objects: key → its position
  };

  // Adds `v` where the parser is (the root, the next array element, or the member named by the
  // last key) and returns where it went.
  Json* place(Json&& v) {
    if (stack_.empty()) {
      *root_ = std::move(v);
      return root_;
    }
    Open& top = stack_.back();
    if (top.value->is_array()) {
      auto& a = top.value->get_ref<Json::array_t&>();
      a.push_back(std::move(v));
      return &a.back();
    }
    auto& members = top.value->get_ref<Json::object_t&>();
    const auto [at, fresh] = top.index.try_emplace(key_, members.size());
    if (!fresh) {
      auto& existing = members.Container::operator[](at->second);
      existing.second = std::move(v);
      return &existing.second;
    }
    members.Container::emplace_back(key_, std::move(v));
    return &members.back().second;
  }
  bool put(Json&& v) {
    place(std::move(v));
    return true;
  }
  bool open(Json&& container) {
    Json* at = place(std::move(container));
    stack_.push_back({at, {}});
    return true;
  }
  bool close() {
    stack_.pop_back();
    return true;
  }

  Json* root_;
  std::vector<Open> stack_;
  std::string key_;
  std::string error_;
};

}  // namespace json_parse_internal

// Parses `text` into *out; false with nlohmann's message in *error when it is not JSON.
inline bool parse_ordered_json(std::string_view text, nlohmann::ordered_json* out, std::string* error = nullptr) {
  json_parse_internal::OrderedBuilder builder(out);
  const bool ok = nlohmann::ordered_json::sax_parse(text.begin(), text.end(), &builder);
  if (!ok && error != nullptr) *error = builder.error();
  return ok;
}

}  // namespace baton
