#include "src/common/state_table.h"

#include <cstdlib>
#include <set>
#include <string>
#include <tuple>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_replace.h"
#include "src/common/logging.h"

namespace tensorverbs {
namespace state_table_internal {

std::atomic<TransitionTap> tap{nullptr};

void RefuseMove(const char* table, const char* from, const char* event, const char* to,
                const std::string& subject) {
  LOG(FATAL) << subject << ": " << table << " has no row " << from << " --" << event << "--> " << to
             << " (docs/architecture/state-machines.md lists the rows)";
  std::abort();  // LOG(FATAL) does not return; this tells the compiler so
}

}  // namespace state_table_internal

void SetTransitionTap(TransitionTap tap) {
  state_table_internal::tap.store(tap, std::memory_order_relaxed);
}

namespace {

// A Mermaid identifier for a state's name: its words joined by underscores.
std::string StateId(const char* name) {
  std::string id;
  for (const char* c = name; *c != '\0'; ++c) {
    const bool word =
        (*c >= 'a' && *c <= 'z') || (*c >= 'A' && *c <= 'Z') || (*c >= '0' && *c <= '9');
    id.push_back(word ? *c : '_');
  }
  return id;
}

// Mermaid ends a transition's label at ';' and starts a comment at '%%'.
std::string Label(absl::string_view text) {
  return absl::StrReplaceAll(text, {{";", ","}, {"%", " percent"}});
}

// A Markdown table cell.
std::string Cell(absl::string_view text) {
  return text.empty() ? "" : absl::StrReplaceAll(text, {{"|", "\\|"}});
}

}  // namespace

std::string RenderStateTable(const StateTableView& t) {
  std::string out = absl::StrCat("## ", t.name, "\n\n```mermaid\nstateDiagram-v2\n");
  for (int s = 0; s < t.state_count; ++s) {
    absl::StrAppend(&out, "  state \"", t.states[s], "\" as ", StateId(t.states[s]), "\n");
  }
  absl::StrAppend(&out, "  [*] --> ", StateId(t.states[t.initial]), "\n");
  for (const StateTableView::Row& r : t.rows) {
    std::string label = t.events[r.event];
    if (*r.guard != '\0') absl::StrAppend(&label, " [", r.guard, "]");
    absl::StrAppend(&out, "  ", StateId(t.states[r.from]), " --> ", StateId(t.states[r.to]), ": ",
                    Label(label), "\n");
  }
  absl::StrAppend(&out, "```\n\n| state | event | guard | next state | action |\n",
                  "|---|---|---|---|---|\n");
  for (const StateTableView::Row& r : t.rows) {
    absl::StrAppend(&out, "| ", t.states[r.from], " | ", t.events[r.event], " | ", Cell(r.guard),
                    " | ", t.states[r.to], " | ", Cell(r.action), " |\n");
  }
  return out;
}

std::string CheckStateTable(const StateTableView& t) {
  std::string problems;
  auto problem = [&](auto&&... parts) { absl::StrAppend(&problems, t.name, ": ", parts..., "\n"); };
  std::set<std::string> names;
  for (int s = 0; s < t.state_count; ++s) {
    if (t.states[s] == nullptr || *t.states[s] == '\0') {
      problem("state ", s, " has no name");
    } else if (!names.insert(t.states[s]).second) {
      problem("two states are named '", t.states[s], "'");
    }
  }
  names.clear();
  for (int e = 0; e < t.event_count; ++e) {
    if (t.events[e] == nullptr || *t.events[e] == '\0') {
      problem("event ", e, " has no name");
    } else if (!names.insert(t.events[e]).second) {
      problem("two events are named '", t.events[e], "'");
    }
  }
  if (!problems.empty()) return problems;
  std::set<std::tuple<int, int, int>> seen;
  std::set<int> events_used;
  for (const StateTableView::Row& r : t.rows) {
    if (r.from < 0 || r.from >= t.state_count || r.to < 0 || r.to >= t.state_count || r.event < 0 ||
        r.event >= t.event_count) {
      problem("a row is out of range (", r.from, ", ", r.event, ", ", r.to, ")");
      continue;
    }
    if (!seen.insert({r.from, r.event, r.to}).second) {
      problem("the row ", t.states[r.from], " --", t.events[r.event], "--> ", t.states[r.to],
              " is there twice");
    }
    events_used.insert(r.event);
  }
  for (int e = 0; e < t.event_count; ++e) {
    if (events_used.count(e) == 0) problem("no row takes the event '", t.events[e], "'");
  }
  // Every state reached from the initial one.
  std::set<int> reached = {t.initial};
  for (bool grew = true; grew;) {
    grew = false;
    for (const StateTableView::Row& r : t.rows) {
      if (reached.count(r.from) != 0 && reached.insert(r.to).second) grew = true;
    }
  }
  for (int s = 0; s < t.state_count; ++s) {
    if (reached.count(s) == 0) problem("no row leads to '", t.states[s], "'");
  }
  return problems;
}

}  // namespace tensorverbs
