#include "src/protocol/fabric_contexts.h"

#include <utility>

#include "absl/strings/str_cat.h"

namespace tensorverbs::protocol {

std::string FabricContext::Name() const {
  const fabric::Capabilities& caps = domain->capabilities();
  return absl::StrCat(caps.backend, " (", caps.provider, ")");
}

FabricContext& FabricContexts::Add(FabricContext::Reach reach,
                                   std::unique_ptr<fabric::Domain> domain,
                                   std::unique_ptr<RdmaMemoryMgr> memory,
                                   const ChannelEnv& shared) {
  auto context = std::make_unique<FabricContext>();
  context->reach = contexts_.empty() ? FabricContext::Reach::kAnyPeer : reach;
  context->domain = std::move(domain);
  context->memory = std::move(memory);
  context->env = shared;
  context->env.domain = context->domain.get();
  context->env.memory = context->memory.get();
  contexts_.push_back(std::move(context));
  set_.reset();  // polled() builds it again over every member
  return *contexts_.back();
}

FabricContext* FabricContexts::FirstWith(FabricContext::Reach reach) const {
  for (size_t i = 1; i < contexts_.size(); ++i) {
    if (contexts_[i]->reach == reach) return contexts_[i].get();
  }
  return nullptr;
}

FabricContext* FabricContexts::OfFamily(absl::string_view family) const {
  for (const auto& c : contexts_) {
    if (c->reach != FabricContext::Reach::kLane && c->family() == family) return c.get();
  }
  return nullptr;
}

std::string FabricContexts::Families() const {
  std::string out;
  for (const auto& c : contexts_) {
    if (c->reach == FabricContext::Reach::kLane) continue;
    absl::StrAppend(&out, out.empty() ? "" : " and ", c->family());
  }
  return out;
}

std::string FabricContexts::Name() const {
  std::string name;
  size_t lanes = 1;
  for (const auto& c : contexts_) {
    if (c->reach == FabricContext::Reach::kLane) {
      ++lanes;
      continue;
    }
    absl::StrAppend(
        &name, name.empty() ? "" : " + ", c->Name(),
        c->reach == FabricContext::Reach::kSameHost && !name.empty() ? " on this host" : "");
  }
  if (lanes > 1) absl::StrAppend(&name, ", ", lanes, " lanes");
  return name;
}

fabric::Domain* FabricContexts::polled() {
  if (contexts_.size() == 1) return contexts_.front()->domain.get();
  if (set_ == nullptr) {
    std::vector<fabric::Domain*> members;
    for (const auto& c : contexts_) members.push_back(c->domain.get());
    set_ = std::make_unique<fabric::DomainSet>(std::move(members));
  }
  return set_.get();
}

void FabricContexts::SetRendezvousMgr(RendezvousMgr* mgr) {
  for (const auto& c : contexts_) c->env.rendezvous_mgr = mgr;
}

RdmaMemoryMgr::RegistrationGauges FabricContexts::Gauges() const {
  RdmaMemoryMgr::RegistrationGauges sum;
  for (const auto& c : contexts_) {
    if (c->memory == nullptr) continue;
    const RdmaMemoryMgr::RegistrationGauges g = c->memory->gauges();
    sum.regions += g.regions;
    sum.bytes += g.bytes;
    sum.endpoint_registrations += g.endpoint_registrations;
    sum.endpoint_bytes += g.endpoint_bytes;
  }
  return sum;
}

void FabricContexts::ReleaseRegistrations() {
  for (const auto& c : contexts_) c->memory.reset();
}

}  // namespace tensorverbs::protocol
