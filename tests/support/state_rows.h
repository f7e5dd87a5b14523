// What the state-table tests share (src/common/state_table.h): RowsTaken records the rows the
// code took while a test ran (install RowsTaken::Tap with SetTransitionTap), and
// ExpectEveryRowWalked holds a table to the list of tests that walk each of its rows. Header
// only; GoogleTest. The tap may be called from any thread.
#ifndef TENSORVERBS_TESTS_SUPPORT_STATE_ROWS_H_
#define TENSORVERBS_TESTS_SUPPORT_STATE_ROWS_H_

#include <gtest/gtest.h>

#include <mutex>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "src/common/state_table.h"

namespace tensorverbs::testing {

// The rows of the state tables the code took while a test ran, as (table, row index); a move
// that is no row is recorded with index -1 (Refused).
class RowsTaken {
 public:
  static void Tap(const char* table, int row) {
    std::lock_guard<std::mutex> lock(mu());
    rows().insert({table, row});
  }
  static void Clear() {
    std::lock_guard<std::mutex> lock(mu());
    rows().clear();
  }
  // Moves a test took that are no row of their table.
  static std::vector<std::string> Refused() {
    std::lock_guard<std::mutex> lock(mu());
    std::vector<std::string> out;
    for (const auto& [table, row] : rows()) {
      if (row < 0) out.push_back(table);
    }
    return out;
  }
  // Whether the test took the row (from, event, to) of `table`.
  template <typename State, typename Event>
  static ::testing::AssertionResult Took(const StateTableView& table, State from, Event event,
                                         State to) {
    const int row =
        RowOf(table, static_cast<int>(from), static_cast<int>(event), static_cast<int>(to));
    if (row < 0) {
      return ::testing::AssertionFailure()
             << table.name << " has no row " << table.states[static_cast<int>(from)] << " --"
             << table.events[static_cast<int>(event)] << "--> "
             << table.states[static_cast<int>(to)];
    }
    std::lock_guard<std::mutex> lock(mu());
    if (rows().count({table.name, row}) == 0) {
      return ::testing::AssertionFailure() << "the test did not take " << table.name << "'s row "
                                           << table.states[static_cast<int>(from)] << " --"
                                           << table.events[static_cast<int>(event)] << "--> "
                                           << table.states[static_cast<int>(to)];
    }
    return ::testing::AssertionSuccess();
  }
  static int RowOf(const StateTableView& table, int from, int event, int to) {
    for (size_t i = 0; i < table.rows.size(); ++i) {
      const StateTableView::Row& r = table.rows[i];
      if (r.from == from && r.event == event && r.to == to) return static_cast<int>(i);
    }
    return -1;
  }

 private:
  static std::mutex& mu() {
    static std::mutex m;
    return m;
  }
  static std::set<std::pair<std::string, int>>& rows() {
    static std::set<std::pair<std::string, int>> taken;
    return taken;
  }
};

// Which test walks a row of a state table: the row, and the test ("Suite.Name") that takes it
// and says so (RowsTaken::Took), in this binary unless `elsewhere` names the one it is in.
struct RowWalk {
  int from;
  int event;
  int to;
  const char* test;
  const char* elsewhere = nullptr;
};

// The walk of row (from, event, to) by `test`, from a machine's own enums.
template <typename State, typename Event>
RowWalk Walk(State from, Event event, State to, const char* test) {
  return RowWalk{static_cast<int>(from), static_cast<int>(event), static_cast<int>(to), test};
}

// Holds `table` to its walks: its shape is sound (CheckStateTable), every row has a walk, every
// walk is a row, and each test named in this binary exists.
inline void ExpectEveryRowWalked(const StateTableView& table, const std::vector<RowWalk>& walks) {
  EXPECT_EQ(CheckStateTable(table), "");
  std::set<std::string> tests;
  const ::testing::UnitTest& unit = *::testing::UnitTest::GetInstance();
  for (int i = 0; i < unit.total_test_suite_count(); ++i) {
    const ::testing::TestSuite& suite = *unit.GetTestSuite(i);
    for (int j = 0; j < suite.total_test_count(); ++j) {
      tests.insert(absl::StrCat(suite.name(), ".", suite.GetTestInfo(j)->name()));
    }
  }
  std::vector<bool> walked(table.rows.size(), false);
  for (const RowWalk& w : walks) {
    const int row = RowsTaken::RowOf(table, w.from, w.event, w.to);
    if (row < 0) {
      ADD_FAILURE() << w.test << " walks " << table.states[w.from] << " --" << table.events[w.event]
                    << "--> " << table.states[w.to] << ", which is no row of " << table.name;
      continue;
    }
    walked[row] = true;
    if (w.elsewhere == nullptr) {
      EXPECT_EQ(tests.count(w.test), 1u) << "no test " << w.test << " in this binary";
    }
  }
  for (size_t i = 0; i < table.rows.size(); ++i) {
    const StateTableView::Row& r = table.rows[i];
    EXPECT_TRUE(walked[i]) << "no test walks " << table.name << "'s row " << table.states[r.from]
                           << " --" << table.events[r.event] << "--> " << table.states[r.to];
  }
}

}  // namespace tensorverbs::testing

#endif  // TENSORVERBS_TESTS_SUPPORT_STATE_ROWS_H_
