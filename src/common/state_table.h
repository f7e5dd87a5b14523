// StateTable: one operation's state machine as data. Each row is (state, event, guard, next
// state, action): in `state`, `event` moves the operation to `next` when `guard` holds, and the
// move does `action`. The guard and action are words for the reader; the code that takes the
// event evaluates the guard and does the action, then calls Move, the one place the operation's
// state changes.
//
// The same table feeds three things, so the diagram is written once:
// - Move checks each move against it (in debug and sanitizer builds, where a move that is no
//   row stops the process naming the table, the states and the event);
// - the unit tests walk every row through the protocol itself, and see each one taken through
//   the transition tap;
// - the diagrams in docs/architecture/state-machines.md are rendered from it
//   (RenderStateTable), and a test fails when the page and the tables differ.
//
// Tables are constant, defined once per machine beside it, and read from any thread. The tap is
// one process-wide function pointer, set by tests only; with none set, a release build's Move
// is a store.
#ifndef TENSORVERBS_COMMON_STATE_TABLE_H_
#define TENSORVERBS_COMMON_STATE_TABLE_H_

#include <atomic>
#include <cstddef>
#include <string>
#include <vector>

namespace tensorverbs {

template <typename State, typename Event>
struct StateRow {
  State from;
  Event event;
  const char* guard;  // "" when the event alone decides
  State to;
  const char* action;  // "" when the move does nothing besides
};

// A table with its types erased: what the renderer and the tap see.
struct StateTableView {
  struct Row {
    int from;
    int event;
    const char* guard;
    int to;
    const char* action;
  };
  const char* name;           // the operation: "RdmaTensorRequest"
  const char* const* states;  // by enum value
  int state_count;
  const char* const* events;  // by enum value
  int event_count;
  int initial;  // the state an operation is made in
  std::vector<Row> rows;
};

// Tests observe moves through this: `table` is the table's name, `row` the index of the row
// taken (-1 when the move is no row).
using TransitionTap = void (*)(const char* table, int row);
void SetTransitionTap(TransitionTap tap);

namespace state_table_internal {
extern std::atomic<TransitionTap> tap;
// Stops the process: `from` --`event`--> `to` is not a row of `table` (`subject` names the
// operation, for the message).
[[noreturn]] void RefuseMove(const char* table, const char* from, const char* event, const char* to,
                             const std::string& subject);
#if !defined(NDEBUG) || defined(TENSORVERBS_DCHECK_ALWAYS_ON)
inline constexpr bool kCheckMoves = true;
#else
inline constexpr bool kCheckMoves = false;
#endif
}  // namespace state_table_internal

template <typename State, typename Event, size_t kStates, size_t kEvents, size_t kRows>
class StateTable {
 public:
  using Row = StateRow<State, Event>;

  constexpr StateTable(const char* name, const char* const (&states)[kStates],
                       const char* const (&events)[kEvents], State initial,
                       const Row (&rows)[kRows])
      : name_(name), initial_(initial) {
    for (size_t i = 0; i < kStates; ++i) states_[i] = states[i];
    for (size_t i = 0; i < kEvents; ++i) events_[i] = events[i];
    for (size_t i = 0; i < kRows; ++i) rows_[i] = rows[i];
  }

  const char* name() const { return name_; }
  const char* StateName(State s) const { return Named(states_, kStates, static_cast<size_t>(s)); }
  const char* EventName(Event e) const { return Named(events_, kEvents, static_cast<size_t>(e)); }

  // The index of the row (from, event, to), or -1.
  constexpr int Find(State from, Event event, State to) const {
    for (size_t i = 0; i < kRows; ++i) {
      if (rows_[i].from == from && rows_[i].event == event && rows_[i].to == to) {
        return static_cast<int>(i);
      }
    }
    return -1;
  }

  // Moves `*state` to `to` on `event`. `subject` is called only to name the operation when the
  // move is refused.
  template <typename Subject>
  void Move(State* state, Event event, State to, Subject&& subject) const {
    const TransitionTap tap = state_table_internal::tap.load(std::memory_order_relaxed);
    if (state_table_internal::kCheckMoves || tap != nullptr) {
      const int row = Find(*state, event, to);
      if (tap != nullptr) tap(name_, row);
      if (state_table_internal::kCheckMoves && row < 0) {
        state_table_internal::RefuseMove(name_, StateName(*state), EventName(event), StateName(to),
                                         subject());
      }
    }
    *state = to;
  }

  StateTableView View() const {
    StateTableView v{name_,
                     states_,
                     static_cast<int>(kStates),
                     events_,
                     static_cast<int>(kEvents),
                     static_cast<int>(initial_),
                     {}};
    v.rows.reserve(kRows);
    for (const Row& r : rows_) {
      v.rows.push_back({static_cast<int>(r.from), static_cast<int>(r.event), r.guard,
                        static_cast<int>(r.to), r.action});
    }
    return v;
  }

 private:
  static const char* Named(const char* const* names, size_t n, size_t i) {
    return i < n ? names[i] : "?";
  }

  const char* name_;
  State initial_;
  const char* states_[kStates] = {};
  const char* events_[kEvents] = {};
  Row rows_[kRows] = {};
};

// The table as a section of docs/architecture/state-machines.md: a heading, a Mermaid state
// diagram and the rows as a Markdown table.
std::string RenderStateTable(const StateTableView& table);
// Checks a table's shape: every state and event named, each name once, rows unique and in
// range, and every state reached from the initial one. Returns the problems, one per line
// (empty when none).
std::string CheckStateTable(const StateTableView& table);

}  // namespace tensorverbs

#endif  // TENSORVERBS_COMMON_STATE_TABLE_H_
