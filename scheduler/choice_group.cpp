#include "scheduler/choice_group.h"

namespace baton {

void ChoiceGroup::publish(std::optional<Source> source) {
  std::vector<Ready> waiting;
  {
    std::lock_guard lock(mu_);
    if (published_) return;
    published_ = true;
    source_ = std::move(source);
    waiting.swap(waiting_);
  }
  for (Ready& ready : waiting) ready(source_);  // source_ is read-only once published
}

void ChoiceGroup::follow(Ready ready) {
  {
    std::lock_guard lock(mu_);
    if (!published_) {
      waiting_.push_back(std::move(ready));
      return;
    }
  }
  ready(source_);
}

}  // namespace baton
