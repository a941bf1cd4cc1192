// The built-ins a chat template calls: the global functions, the methods of strings and dicts,
// the filters and the tests, applied to values the renderer has already evaluated (jinja.cpp
// evaluates the arguments; these only compute). Internal to the template engine.
//
// Errors are thrown as RenderError with the message the template's author sees; the renderer
// adds the line. The names handled here are the ones jinja_parser.cpp accepts (is_known_*): the
// function, filter and test tables take their last name (strftime_now, map, in) unchecked, so a
// name added to the parser must be added here.
#pragma once

#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "model/jinja_value.h"

namespace baton::jinja {

// A call's or a filter's arguments, evaluated: positional ones, then keyword ones.
struct CallArgs {
  std::vector<Value> positional;
  std::vector<std::pair<std::string, Value>> keyword;

  // The keyword argument `name`, or undefined.
  Value named(std::string_view name) const {
    for (const auto& [k, v] : keyword) {
      if (k == name) return v;
    }
    return Value();
  }
  // Parameter `i` of the callee, called `name`: given by position or by keyword, else undefined.
  Value operator()(size_t i, std::string_view name) const {
    return i < positional.size() ? positional[i] : named(name);
  }
};

// raise_exception, namespace, dict, range, strftime_now (`name` one the parser accepts).
Value builtin_function(const std::string& name, const CallArgs& arg);
// obj.name(arg...): Python's str and dict methods.
Value builtin_method(const Value& obj, const std::string& name, const CallArgs& arg);
// v | name(arg...).
Value builtin_filter(const std::string& name, const Value& v, const CallArgs& arg);
// v is name(args...).
bool builtin_test(const std::string& name, const Value& v, const std::vector<Value>& args);

}  // namespace baton::jinja
