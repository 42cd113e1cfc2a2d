#include "layered.h"

#include <algorithm>
#include <string>

namespace nixlnode {

namespace {
std::string num(size_t n) { return std::to_string(n); }
}  // namespace

Handle LayeredRequests::make(Engine& e, XferOp op, Handle local, const uint32_t* li, size_t nl, Handle remote,
                             const uint32_t* ri, size_t nr, const uint32_t* bounds, size_t nb,
                             std::optional<std::string> notif, const std::string& remoteAgent) {
  if (nb < 2) throw EngineError(ERR_INVALID_PARAM, "makeLayeredXfer: a layered transfer needs at least one layer");
  if (nl != nr)
    throw EngineError(ERR_INVALID_PARAM,
                      "makeLayeredXfer: " + num(nl) + " local vs " + num(nr) + " remote indices in all");
  if (bounds[0] != 0 || bounds[nb - 1] != nl)
    throw EngineError(ERR_INVALID_PARAM, "makeLayeredXfer: layer bounds must run from 0 to the number of indices");
  if (free_.empty() && slots_.size() == kLayeredSlots)
    throw EngineError(ERR_NOT_ALLOWED, "makeLayeredXfer: " + num(kLayeredSlots) +
                                           " layered transfers alive at once, or the handles ran out; release some "
                                           "first");
  Request r;
  r.remoteAgent = remoteAgent;
  r.notif = std::move(notif);
  size_t layers = nb - 1;
  r.subs.reserve(layers);
  r.state.assign(layers, kIdle);
  try {
    for (size_t l = 0; l < layers; ++l) {
      if (bounds[l + 1] <= bounds[l])
        throw EngineError(ERR_INVALID_PARAM, "makeLayeredXfer: layer " + num(l) + " has no blocks");
      size_t b = bounds[l], n = bounds[l + 1] - b;
      try {
        r.subs.push_back(e.makeXferReq(op, local, li + b, n, remote, ri + b, n, nullptr));
      } catch (const EngineError& x) {
        throw EngineError(x.status, "makeLayeredXfer: layer " + num(l) + ": " + x.what());
      }
    }
  } catch (...) {
    for (Handle s : r.subs) e.releaseXferReq(s);
    throw;
  }
  for (Handle s : r.subs) r.layerBytes.push_back(e.xferBytes(s));
  uint32_t i;
  if (!free_.empty()) {
    i = free_.back();
    free_.pop_back();
  } else {
    i = static_cast<uint32_t>(slots_.size());
    slots_.emplace_back();
  }
  Slot& slot = slots_[i];
  slot.live = true;
  slot.r = std::move(r);
  for (uint32_t l = 0; l < slot.r.subs.size(); ++l) owner_[slot.r.subs[l]] = {i, l};
  return idOf(i);
}

LayeredRequests::Request& LayeredRequests::find(Handle h, const char* what) {
  uint32_t i = slotOf(h);
  if (!isLayered(h) || i >= slots_.size() || !slots_[i].live || idOf(i) != h)
    throw EngineError(ERR_NOT_FOUND, std::string(what) + ": unknown or already released layered transfer handle");
  return slots_[i].r;
}

// Starts a new posting when the last one had every layer posted (or none was
// ever made); refuses one while that posting still moves bytes. Within a
// posting, refuses a layer already posted (UINT32_MAX: no layer to check).
void LayeredRequests::begin(Engine& e, Request& r, uint32_t layer) {
  uint32_t n = static_cast<uint32_t>(r.subs.size());
  if (r.status != ERR_NOT_POSTED && r.posted < n) {
    if (layer < n && r.state[layer] != kIdle)
      throw EngineError(ERR_REPOST_ACTIVE, "postLayer: layer " + num(layer) + " was already posted in this posting (" +
                                               num(r.posted) + " of " + num(n) + " layers posted)");
    return;
  }
  if (r.inflight > 0)
    throw EngineError(ERR_REPOST_ACTIVE, "postLayer: " + num(r.inflight) +
                                             " layers of the last posting are still in flight; wait for it first");
  if (r.notifLayer != kNoLayer) {
    e.clearNotif(r.subs[r.notifLayer]);  // the next posting's last layer may be another
    r.notifLayer = kNoLayer;
  }
  std::fill(r.state.begin(), r.state.end(), kIdle);
  r.posted = r.done = 0;
  r.status = IN_PROG;
  r.err.clear();
}

int LayeredRequests::postLayer(Engine& e, Handle h, uint32_t layer, bool mayInline, uint32_t* inProg) {
  Request& r = find(h, "postLayer");
  if (layer >= r.subs.size())
    throw EngineError(ERR_INVALID_PARAM, "postLayer: layer " + num(layer) + " is out of range (the transfer has " +
                                             num(r.subs.size()) + " layers)");
  begin(e, r, layer);
  postOne(e, r, layer, mayInline, inProg);
  finishIfDone(e, r);
  return r.status;
}

uint64_t LayeredRequests::maxLayerBytes(Handle h) {
  const auto& b = find(h, "makeLayeredXfer").layerBytes;
  return b.empty() ? 0 : *std::max_element(b.begin(), b.end());
}

int LayeredRequests::postAll(Engine& e, Handle h, const std::string* notif, bool mayInline, uint64_t inlineBytes,
                             uint32_t* inProg) {
  Request& r = find(h, "transfer");
  begin(e, r, UINT32_MAX);  // any layer: postAll posts only those not yet posted
  if (notif) r.notif = *notif;
  // One call posts every layer: inline, they would all copy on the calling
  // thread. At most inlineBytes of them do, as one request of that size
  // would; from the first layer past it on, the engine's thread posts them.
  for (uint32_t l = 0; l < r.subs.size(); ++l) {
    if (r.state[l] != kIdle) continue;
    bool inl = mayInline && r.layerBytes[l] <= inlineBytes;
    if (inl)
      inlineBytes -= r.layerBytes[l];
    else
      mayInline = false;
    postOne(e, r, l, inl, inProg);
  }
  finishIfDone(e, r);
  return r.status;
}

void LayeredRequests::postOne(Engine& e, Request& r, uint32_t l, bool mayInline, uint32_t* inProg) {
  r.posted++;
  if (r.status < 0) {  // the posting failed: its remaining layers move nothing
    r.state[l] = kSkipped;
    return;
  }
  // On an engine that posts in order the posting's last layer carries the
  // notification: it goes out after every earlier layer's bytes, before any
  // later transfer's, and a notification the peer never takes fails the
  // posting, as a request's own does. Elsewhere it is sent once DONE.
  const std::string* notif = nullptr;
  if (r.posted == r.subs.size() && r.notif && e.postsInOrder()) {
    notif = &*r.notif;
    r.notifLayer = l;
  }
  int s;
  std::string msg;
  try {
    // The peer's process is checked once per posting, at its end
    // (finishIfDone), after every layer's copy: a peer that died before or
    // during the posting fails it there (a copy from or to its memfd mapping
    // touches only that mapping; process_vm_* fails by itself). The layer that
    // carries the notification checks it too, before sending.
    s = e.postXferReq(r.subs[l], notif, mayInline, notif != nullptr, r.posted < r.subs.size());
  } catch (const EngineError& x) {
    s = x.status;
    msg = x.what();
  }
  if (s == IN_PROG) {
    r.state[l] = kInFlight;
    r.inflight++;
    ++*inProg;
    return;
  }
  if (s < 0 && msg.empty()) e.getXferStatus(r.subs[l], &msg);
  settle(e, r, l, s, msg);
}

// A layer left IN_PROG (or finished inside its post) with status s.
void LayeredRequests::settle(Engine& e, Request& r, uint32_t l, int s, const std::string& msg) {
  if (r.state[l] == kInFlight) r.inflight--;
  if (s == SUCCESS) {
    r.state[l] = kDone;
    r.done++;
    return;
  }
  r.state[l] = kFailed;
  if (r.status == IN_PROG) {
    r.status = s;
    r.err = "layer " + num(l) + ": " + msg;
  }
}

void LayeredRequests::finishIfDone(Engine& e, Request& r) {
  if (r.status != IN_PROG || r.done < r.subs.size()) return;
  if (!e.peerAlive(r.remoteAgent)) {
    r.status = ERR_REMOTE_DISCONNECT;
    r.err = "agent '" + r.remoteAgent + "' is gone (process exited) before the last layer was confirmed";
    return;
  }
  if (r.notif && r.notifLayer == kNoLayer) {
    try {
      e.genNotif(r.remoteAgent, *r.notif);
    } catch (const EngineError& x) {
      r.status = x.status;
      r.err = std::string("every layer moved, but the notification failed: ") + x.what();
      return;
    }
  }
  r.status = SUCCESS;
}

int LayeredRequests::status(Engine& e, Handle h, std::string* err, bool* ended) {
  Request& r = find(h, "checkXferState");
  *ended = false;
  if (r.status == IN_PROG && r.inflight > 0) {
    for (uint32_t l = 0; l < r.subs.size(); ++l) {
      if (r.state[l] != kInFlight) continue;
      std::string msg;
      int s = e.getXferStatus(r.subs[l], &msg);
      if (s != IN_PROG) settle(e, r, l, s, msg);
    }
    finishIfDone(e, r);
    *ended = r.status != IN_PROG;
  }
  if (r.status < 0 && err) *err = r.status == ERR_NOT_POSTED ? "transfer was never posted" : r.err;
  return r.status;
}

bool LayeredRequests::onEngineDone(Engine& e, Handle sub, Handle* ended) {
  *ended = 0;
  auto it = owner_.find(sub);
  if (it == owner_.end()) return false;
  auto [i, l] = it->second;
  Request& r = slots_[i].r;
  Handle h = idOf(i);
  // Already seen finished (status() asked first), or the event of an earlier
  // posting delivered after the layer was posted again: nothing new.
  if (r.state[l] != kInFlight) return true;
  std::string msg;
  int s = e.getXferStatus(sub, &msg);
  if (s == IN_PROG) return true;
  bool wasOpen = r.status == IN_PROG;
  settle(e, r, l, s, msg);
  finishIfDone(e, r);
  if (wasOpen && r.status != IN_PROG) *ended = h;
  return true;
}

void LayeredRequests::release(Engine& e, Handle h) {
  Request& r = find(h, "releaseXferHandle");
  uint32_t i = slotOf(h);
  // Every layer's request goes, even if one release throws: the first error
  // is reported once the rest are released.
  std::optional<EngineError> first;
  for (Handle s : r.subs) {
    owner_.erase(s);
    try {
      e.releaseXferReq(s);
    } catch (const EngineError& x) {
      if (!first) first = x;
    }
  }
  retire(i);
  if (first) throw *first;
}

Handle LayeredRequests::idOf(uint32_t i) const { return kLayeredBit | slots_[i].gen << kLayeredSlotBits | i; }

uint32_t LayeredRequests::slotOf(Handle h) { return static_cast<uint32_t>(h & (kLayeredSlots - 1)); }

// The slot's request goes and its next generation comes, if it has one: a
// handle is never handed out twice, so a stale one is refused even once its
// slot serves another.
void LayeredRequests::retire(uint32_t i) {
  Slot& slot = slots_[i];
  slot.live = false;
  slot.r = Request{};
  if (++slot.gen < kLayeredGens) free_.push_back(i);
}

void LayeredRequests::clear() {
  // Generations carry on: handles of a closed agent stay refused.
  for (uint32_t i = 0; i < slots_.size(); ++i)
    if (slots_[i].live) retire(i);
  owner_.clear();
}

}  // namespace nixlnode
