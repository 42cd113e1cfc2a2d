// Layered transfer requests: one request whose layers are posted one by one,
// as each layer of a KV cache is ready (vLLM's save_kv_layer, LMCache and
// Mooncake send a layer's blocks as the layer finishes), and which completes
// once: one state, one wait, one notification after every layer's bytes.
//
// NIXL has no partial post, so a layered request is one engine request per
// layer, all made up front; posting a layer posts its request (inline on the
// calling thread when the engine allows it). Built on the engine boundary
// only, it serves both engines. Every call comes from the JS thread: the
// state here needs no lock.
//
// A posting is every layer posted once. It ends DONE when every layer is
// done (then the notification goes, with genNotif: on NIXL a request is DONE
// only after UCX's flush, so the peer's bytes are in place), or ERR as soon as
// one layer fails; the failed posting's remaining layers are then not sent
// (postLayer returns the error). The next postLayer after a posting in which
// every layer was posted, with none still in flight, starts a new posting.
#pragma once
#include <cstdint>
#include <optional>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "../engine.h"

namespace nixlnode {

// Layered request ids live above every engine handle (engines count from 1
// and stop below kEngineHandleLimit), under 2^53 so JS numbers hold them.
// Below that bit: the request's slot in LayeredRequests' table, and the
// slot's generation, so a lookup is an index and a compare, not a hash; a
// released handle never matches its slot again (see retire).
constexpr Handle kLayeredBit = kEngineHandleLimit;
static_assert((kLayeredBit << 1) - 1 == kMaxHandle, "layered ids fill [kLayeredBit, 2^53)");
inline bool isLayered(Handle h) { return (h & kLayeredBit) != 0; }
constexpr uint32_t kNoLayer = UINT32_MAX;
constexpr unsigned kLayeredSlotBits = 16;  // layered requests alive at once: 65,536
constexpr uint32_t kLayeredSlots = 1u << kLayeredSlotBits;
// Handles per slot: 2^36, 2^52 in all (a million layered requests a second
// for 142 years) before makeLayeredXfer refuses for want of ids.
constexpr Handle kLayeredGens = kLayeredBit >> kLayeredSlotBits;

class LayeredRequests {
 public:
  // bounds: layers + 1 offsets into the index arrays (layer l is
  // [bounds[l], bounds[l + 1])). notif goes to remoteAgent once per posting.
  Handle make(Engine& e, XferOp op, Handle local, const uint32_t* li, size_t nl, Handle remote, const uint32_t* ri,
              size_t nr, const uint32_t* bounds, size_t nb, std::optional<std::string> notif,
              const std::string& remoteAgent);
  // The request's state after posting the layer: IN_PROG, SUCCESS (this layer
  // finished the posting) or the posting's error. *inProg counts the engine
  // posts that left IN_PROG (one completion event each follows).
  int postLayer(Engine& e, Handle h, uint32_t layer, bool mayInline, uint32_t* inProg);
  // The most bytes one layer moves (Engine::xferBytes; UINT64_MAX: unknown).
  uint64_t maxLayerBytes(Handle h);
  // Every layer not yet posted in this posting (postXferReq on a layered id),
  // at most inlineBytes of them on the calling thread.
  int postAll(Engine& e, Handle h, const std::string* notif, bool mayInline, uint64_t inlineBytes, uint32_t* inProg);
  // Asks the engine about layers in flight; *ended: the posting ended here.
  int status(Engine& e, Handle h, std::string* err, bool* ended);
  void release(Engine& e, Handle h);
  // An engine request finished (its completion event). False: not a layer.
  // *ended: the layered request whose posting it ended, else 0.
  bool onEngineDone(Engine& e, Handle sub, Handle* ended);
  void clear();

 private:
  enum : uint8_t { kIdle, kInFlight, kDone, kFailed, kSkipped };
  struct Request {
    std::vector<Handle> subs;          // per layer
    std::vector<uint8_t> state;        // per layer, this posting
    std::vector<uint64_t> layerBytes;  // per layer (Engine::xferBytes; UINT64_MAX: unknown)
    std::string remoteAgent;
    std::optional<std::string> notif;
    uint32_t posted = 0;    // layers posted (or skipped) in this posting
    uint32_t inflight = 0;  // layers posted IN_PROG and not yet seen finished
    uint32_t done = 0;      // layers DONE in this posting
    // The layer whose engine request carries the notification in this posting
    // (an engine that posts in order), else kNoLayer: genNotif once DONE.
    uint32_t notifLayer = kNoLayer;
    int status = ERR_NOT_POSTED;
    std::string err;
  };

  // A slot: its generation (the handle's upper bits) and, while live, its
  // request. A slot whose generations are spent is retired, never reused.
  struct Slot {
    Handle gen = 0;
    bool live = false;
    Request r;
  };

  Request& find(Handle h, const char* what);
  Handle idOf(uint32_t slot) const;  // the live request's id in that slot
  static uint32_t slotOf(Handle h);
  void retire(uint32_t slot);
  void begin(Engine& e, Request& r, uint32_t layer);
  void postOne(Engine& e, Request& r, uint32_t l, bool mayInline, uint32_t* inProg);
  void settle(Engine& e, Request& r, uint32_t l, int s, const std::string& msg);
  void finishIfDone(Engine& e, Request& r);

  std::vector<Slot> slots_;
  std::vector<uint32_t> free_;                                       // slots to reuse, with a generation left
  std::unordered_map<Handle, std::pair<uint32_t, uint32_t>> owner_;  // engine request -> (slot, layer)
};

}  // namespace nixlnode
