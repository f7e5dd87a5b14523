// The request's state machine (RdmaTensorRequest, tensor_request.h) as one table of rows
// (state_table.h): tensor_request.cc moves by it, the unit tests walk it, and
// docs/architecture/state-machines.md draws it. Included by tensor_request.cc only.
#ifndef TENSORVERBS_PROTOCOL_REQUEST_TABLE_H_
#define TENSORVERBS_PROTOCOL_REQUEST_TABLE_H_

#include <iterator>

#include "src/common/state_table.h"
#include "src/protocol/tensor_request.h"

namespace tensorverbs::protocol::request_machine {

using State = RdmaTensorRequest::State;
using Event = RdmaTensorRequest::Event;

inline constexpr const char* kStateNames[] = {
    "queued",       "requested", "awaiting a grant", "meta-data parked", "re-requested",
    "landed ahead", "done"};
inline constexpr const char* kEventNames[] = {"Start",   "MetaData", "Grant",       "Adopt",
                                              "Release", "Content",  "ErrorStatus", "Abort",
                                              "Close",   "LaneLost"};
static_assert(std::size(kStateNames) == RdmaTensorRequest::kStates);
static_assert(std::size(kEventNames) == RdmaTensorRequest::kEvents);

// The request's machine, row by row (state_table.h).
inline constexpr StateRow<State, Event> kRequestRows[] = {
    {State::kQueued, Event::kStart, "", State::kRequested,
     "REQUEST, naming the destination when the meta-data is cached"},
    {State::kQueued, Event::kStart, "the destination cannot be made", State::kDone,
     "end the recv with the error"},
    {State::kQueued, Event::kAbort, "", State::kDone, "forget it: nothing was sent"},
    {State::kQueued, Event::kClose, "", State::kDone, "end the recv"},
    {State::kRequested, Event::kMetaData, "pushed, and no recv took it", State::kMetaParked,
     "keep the answer for a recv"},
    {State::kRequested, Event::kMetaData, "large, and the channel has no grant left",
     State::kAwaitingGrant, "queue for a grant"},
    {State::kRequested, Event::kMetaData, "", State::kReRequested,
     "RE_REQUEST with a destination (none once the recv ended)"},
    {State::kRequested, Event::kContent, "pushed, and no recv took it", State::kLandedAhead,
     "keep the tensor for a recv"},
    {State::kRequested, Event::kContent, "", State::kDone, "deliver"},
    {State::kRequested, Event::kErrorStatus, "", State::kDone, "end the recv with the error"},
    {State::kRequested, Event::kClose, "", State::kDone,
     "end the recv, quarantine the destination"},
    {State::kRequested, Event::kLaneLost, "", State::kDone,
     "end the recv, quarantine the destination"},
    {State::kAwaitingGrant, Event::kGrant, "", State::kReRequested,
     "RE_REQUEST with a destination (none once the recv ended)"},
    {State::kAwaitingGrant, Event::kErrorStatus, "", State::kDone, "end the recv with the error"},
    {State::kAwaitingGrant, Event::kClose, "", State::kDone, "end the recv"},
    {State::kMetaParked, Event::kAdopt, "", State::kReRequested,
     "RE_REQUEST with a destination that fits"},
    {State::kMetaParked, Event::kRelease, "declined", State::kReRequested,
     "RE_REQUEST without a destination: the sender drops the tensor"},
    {State::kMetaParked, Event::kErrorStatus, "", State::kDone, "forget it"},
    {State::kMetaParked, Event::kClose, "", State::kDone, "forget it"},
    {State::kReRequested, Event::kContent, "", State::kDone, "deliver (nothing once ended)"},
    {State::kReRequested, Event::kErrorStatus, "", State::kDone, "end the recv with the error"},
    {State::kReRequested, Event::kClose, "", State::kDone,
     "end the recv, quarantine the destination"},
    {State::kReRequested, Event::kLaneLost, "", State::kDone,
     "end the recv, quarantine the destination"},
    {State::kLandedAhead, Event::kAdopt, "", State::kDone, "deliver the landed tensor"},
    {State::kLandedAhead, Event::kAbort, "", State::kDone, "decline: its step ended"},
    {State::kLandedAhead, Event::kClose, "", State::kDone,
     "keep the tensor in the landed store for its recv"},
};

inline constexpr StateTable kRequestTable("RdmaTensorRequest", kStateNames, kEventNames,
                                          State::kQueued, kRequestRows);

}  // namespace tensorverbs::protocol::request_machine

#endif  // TENSORVERBS_PROTOCOL_REQUEST_TABLE_H_
