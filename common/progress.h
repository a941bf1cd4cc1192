// Model-loading progress for people and for log collectors: a bar redrawn in place when stderr is
// a terminal, otherwise a log line every 25 %.
#pragma once

#include <functional>
#include <string>

namespace baton {

// A callback for Model::load (done, total) that reports on stderr; `what` names the thing loaded.
// `log` receives the non-terminal lines (e.g. spdlog::info); when null they go to stderr as is.
std::function<void(int, int)> load_progress_reporter(const std::string& what,
                                                     std::function<void(const std::string&)> log = {});

}  // namespace baton
