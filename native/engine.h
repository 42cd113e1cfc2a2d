// The engine boundary: everything the addon needs from a transfer engine.
// Two implementations exist: LoopbackEngine (native/loopback/, no library, one
// host) and NixlEngine (native/nixl/, wraps nixlAgent when NIXL is installed).
// The addon (native/addon/: agent, arguments, errors, module) only talks to
// this interface.
//
// Threading: every method is called from the JS main thread. Engines run their
// own progress thread(s) and report finished requests through CompletionSink
// from those threads; the sink batches them for the event loop.
#pragma once
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "local_pages.h"
#include "status.h"

namespace nixlnode {

// Same order as NIXL's nixl_mem_t.
enum class MemType : uint8_t { DRAM = 0, VRAM = 1, BLK = 2, OBJ = 3, FILE = 4 };
enum class XferOp : uint8_t { READ = 0, WRITE = 1 };

struct Desc {
  uint64_t addr;
  uint64_t len;
  uint64_t devId;
};

// [addr, addr + len) without wrapping past 2^64.
inline bool descWraps(uint64_t addr, uint64_t len) { return len > UINT64_MAX - addr; }

// [addr, addr + len) inside [base, base + size), computed so that no sum can
// wrap: a descriptor whose end overflows is never "inside" anything.
inline bool descWithin(uint64_t addr, uint64_t len, uint64_t base, uint64_t size) {
  return addr >= base && len <= size && addr - base <= size - len;
}

// Registrations, descriptor lists and transfer requests share one counter
// per agent, from 1. JS holds handles as numbers (doubles), so every id stays
// below 2^53: engine handles below kEngineHandleLimit, the addon's layered
// ids in [kEngineHandleLimit, 2^53). At a million handles a second an agent
// takes 142 years to reach the limit; one that does is refused new handles
// (HandleCounter), never handed one that wraps or collides.
using Handle = uint64_t;
constexpr Handle kEngineHandleLimit = Handle{1} << 52;
constexpr Handle kMaxHandle = (Handle{1} << 53) - 1;
using Params = std::map<std::string, std::string>;

struct Telemetry {
  uint64_t startTimeUs;  // wall clock (epoch) microseconds at post
  uint64_t postDurationUs;
  uint64_t xferDurationUs;
  uint64_t totalBytes;
  uint64_t descCount;
};

struct EngineConfig {
  std::vector<std::string> backends;  // created at construction
  bool progressThread = true;         // NIXL's own progress thread (nixl engine)
  uint32_t progressDelayUs = 1000;    // NIXL pthrDelay: 0 would spin a core
  bool captureTelemetry = false;
  int listenPort = 0;  // NIXL's own metadata listener (0 = off)
  // Tests only: the loopback worker waits this long before each transfer, so
  // "while in flight" cases are deterministic instead of racing a fast copy.
  // Non-zero also turns inline posting off.
  uint32_t testDelayUs = 0;
  // Tests only: the first handle the engine hands out (0: 1), so a test can
  // reach the handle counter's limits without making billions of handles.
  Handle testFirstHandle = 0;
  // A transfer of at most this many bytes is posted on the calling (JS)
  // thread when nothing posted before it still waits for the engine's thread:
  // below this size the copy costs less than the hop to that thread and the
  // completion's hop back (futex wake, context switch, the loop's wake-up).
  // 0: every transfer goes through the engine's thread.
  uint32_t inlineMaxBytes = 0;
  // A larger transfer is posted there too when its previous post took at most
  // this many microseconds (0: never): what blocks the event loop is the time
  // a post takes, not its size. A copy of a few MiB costs a few hundred
  // microseconds, the hop several tens; a post that hands the bytes to a NIC
  // (RDMA) returns in microseconds whatever its size. Its first post, not yet
  // timed, is predicted from the last timed post to the same remote agent
  // (PostRate); with none yet, it goes through the engine's thread.
  uint32_t inlineMaxUs = 0;
};

// A request's last post time, before it was ever timed.
constexpr uint32_t kPostUsUnknown = UINT32_MAX;

// Whether a request moving `bytes`, whose last post took `postUs`, may be
// posted on the calling thread (EngineConfig::inlineMaxBytes, inlineMaxUs).
inline bool inlineAllowed(const EngineConfig& cfg, uint64_t bytes, uint32_t postUs) {
  if (cfg.inlineMaxBytes == 0) return false;
  if (bytes <= cfg.inlineMaxBytes) return true;
  return cfg.inlineMaxUs != 0 && postUs != kPostUsUnknown && postUs <= cfg.inlineMaxUs;
}

// What the last timed post to one remote agent cost, so that a request's
// first post, never timed, can be predicted (a READ's: expectedPostUs): a
// puller makes a new request per transfer, and each would otherwise take
// the hop to the engine's thread and back. The sample is scaled by the larger of the two
// ratios, bytes and descriptors: a copy (UCX cma, the loopback engine) costs
// per byte, a post that hands the bytes to a NIC per descriptor, and one
// sample cannot tell them apart. A request with more bytes than the sample
// is not predicted: its memory may be pages never touched (a KV pool hands
// back its warm low blocks first, and a long prompt's reach new ones), whose
// faults cost several times the copy (a 12 MiB first post predicted at
// ~450 us from warm 1.25 MiB samples held the event loop 8 ms); it goes
// through the engine's thread once, and its time is the next sample.
// Each timed post replaces the sample, so a machine that gets slower sends
// the next first post back to the engine's thread. A removed agent's sample
// goes with it (engines make a new PostRate when it is loaded again).
// Written by whichever thread posted, read by the JS thread: a mutex, taken
// only by posts over inlineMaxBytes, keeps the three numbers one sample.
class PostRate {
 public:
  // A post of `bytes` in `descs` descriptors took `us` and was accepted.
  void record(uint64_t bytes, uint64_t descs, uint32_t us) {
    if (bytes == 0 || descs == 0 || us == kPostUsUnknown) return;
    std::lock_guard<std::mutex> lk(mu_);
    bytes_ = bytes;
    descs_ = descs;
    us_ = std::max<uint32_t>(us, 1);  // under a microsecond is not free: scaled, it grows
  }
  // kPostUsUnknown with no sample yet, or for more bytes than it had.
  uint32_t predictUs(uint64_t bytes, uint64_t descs) const {
    uint64_t sb, sd;
    uint32_t su;
    {
      std::lock_guard<std::mutex> lk(mu_);
      if (us_ == kPostUsUnknown || bytes > bytes_) return kPostUsUnknown;
      sb = bytes_;
      sd = descs_;
      su = us_;
    }
    double scale = std::max(static_cast<double>(bytes) / static_cast<double>(sb),
                            static_cast<double>(descs) / static_cast<double>(sd));
    double us = static_cast<double>(su) * scale;
    constexpr double kMax = static_cast<double>(kPostUsUnknown - 1);
    return us >= kMax ? kPostUsUnknown - 1 : static_cast<uint32_t>(std::ceil(us));
  }

 private:
  mutable std::mutex mu_;
  uint64_t bytes_ = 0, descs_ = 0;
  uint32_t us_ = kPostUsUnknown;
};

// The post time inlineAllowed weighs for a request: its own last one (the
// better evidence), else, never timed and over inlineMaxBytes, what its
// remote agent's last timed post predicts, for a READ whose local pages are
// all resident (LocalPages). A WRITE's first post is not predicted: the
// pages it fills are the peer's, and whether they were ever touched cannot
// be told from this process (UCX's cma writes into the peer's memory).
inline uint32_t expectedPostUs(const EngineConfig& cfg, XferOp op, uint64_t bytes, uint64_t descs, uint32_t ownUs,
                               const PostRate& rate, const LocalPages& pages) {
  if (ownUs != kPostUsUnknown || cfg.inlineMaxUs == 0 || bytes <= cfg.inlineMaxBytes) return ownUs;
  if (op != XferOp::READ) return kPostUsUnknown;
  uint32_t us = rate.predictUs(bytes, descs);
  if (us > cfg.inlineMaxUs) return us;  // through the engine's thread anyway: no need to look at the pages
  return pages.resident() ? us : kPostUsUnknown;
}

// Microseconds since t0, below kPostUsUnknown.
inline uint32_t postUsSince(std::chrono::steady_clock::time_point t0) {
  auto us = std::chrono::duration_cast<std::chrono::microseconds>(std::chrono::steady_clock::now() - t0).count();
  return static_cast<uint32_t>(std::min<int64_t>(std::max<int64_t>(us, 0), kPostUsUnknown - 1));
}

// An engine's handle counter. check() before making anything, take() once
// made: a refused call leaves nothing behind.
class HandleCounter {
 public:
  void start(Handle first) {
    if (first) next_ = first;
  }
  void check(const char* call) const {
    if (next_ >= kEngineHandleLimit)
      throw EngineError(ERR_NOT_ALLOWED, std::string(call) +
                                             ": out of handles: this agent has made 2^52 - 1 registrations, lists "
                                             "and requests; make a new agent");
  }
  Handle take(const char* call) {
    check(call);
    return next_++;
  }

 private:
  Handle next_ = 1;
};

struct PluginInfo {
  Params params;
  std::vector<MemType> memTypes;
};

// Called from engine threads. onComplete for every posting that left IN_PROG
// there; onNotif when at least one notification was queued. onCompleteHere
// instead of onComplete for a posting found finished on the JS thread, inside
// an engine call made from it (getXferStatus): the caller already sees the
// final status, and no event needs to cross threads for it.
class CompletionSink {
 public:
  virtual ~CompletionSink() = default;
  virtual void onComplete(Handle h) = 0;
  virtual void onCompleteHere(Handle h) = 0;
  virtual void onNotif() = 0;
};

class Engine {
 public:
  virtual ~Engine() = default;
  virtual const char* kind() const = 0;  // "loopback" | "nixl"

  virtual std::vector<std::string> getPluginList() = 0;
  virtual PluginInfo getPluginParams(const std::string& plugin) = 0;
  virtual void createBackend(const std::string& plugin, const Params& params) = 0;
  virtual std::vector<std::string> getBackends() = 0;
  // A created backend's parameters as it runs, defaults included, and its
  // memory types (NIXL getBackendParams); ERR_NOT_FOUND for one not created.
  virtual PluginInfo getBackendParams(const std::string& backend) = 0;

  // A registration is a list of descriptors registered (and later
  // deregistered) together.
  virtual Handle registerMem(const std::vector<Desc>& descs, MemType type,
                             const std::vector<std::string>& backends) = 0;
  virtual void deregisterMem(Handle reg) = 0;

  virtual std::string getLocalMD() = 0;
  // Only the registrations covering descs (with connection info if asked):
  // loading it for an agent already known adds those registrations.
  virtual std::string getLocalPartialMD(const std::vector<Desc>& descs, MemType type, bool includeConnInfo,
                                        const std::vector<std::string>& backends) = 0;
  virtual std::string loadRemoteMD(const std::string& md) = 0;  // -> agent name
  virtual void invalidateRemoteMD(const std::string& agent) = 0;
  // NIXL's own metadata exchange (peer listener at ip:port, or etcd when ip is empty). label: the
  // metadata server's key of partial metadata (required there), and the one a fetch reads (empty: the
  // full metadata's); peers ignore it.
  virtual void sendLocalMD(const std::string& ip, int port) = 0;
  virtual void sendLocalPartialMD(const std::vector<Desc>& descs, MemType type, bool includeConnInfo,
                                  const std::vector<std::string>& backends, const std::string& ip, int port,
                                  const std::string& label) = 0;
  virtual void fetchRemoteMD(const std::string& agent, const std::string& ip, int port, const std::string& label) = 0;
  virtual void invalidateLocalMD(const std::string& ip, int port) = 0;
  // True when the agent (and, if given, memory covering descs) is known.
  virtual bool checkRemoteMD(const std::string& agent, const std::vector<Desc>& descs, MemType type) = 0;
  virtual void makeConnection(const std::string& agent) = 0;
  // Per descriptor: the backend's answer, or nullopt when the memory is unknown to it.
  virtual std::vector<std::optional<Params>> queryMem(const std::vector<Desc>& descs, MemType type,
                                                      const std::vector<std::string>& backends) = 0;

  // agent "" = the local side (NIXL_INIT_AGENT).
  virtual Handle prepXferDlist(const std::string& agent, const std::vector<Desc>& descs, MemType type,
                               const std::vector<std::string>& backends) = 0;
  virtual void releaseDlist(Handle dlist) = 0;

  virtual Handle makeXferReq(XferOp op, Handle localDlist, const uint32_t* localIdx, size_t nLocal, Handle remoteDlist,
                             const uint32_t* remoteIdx, size_t nRemote, const std::string* notif) = 0;
  virtual Handle createXferReq(XferOp op, const std::vector<Desc>& local, MemType localType,
                               const std::vector<Desc>& remote, MemType remoteType, const std::string& remoteAgent,
                               const std::string* notif) = 0;
  // notif: nullptr keeps the request's message; otherwise replaces it.
  // mayInline: false sends it through the engine's thread whatever its size.
  // IN_PROG: onComplete follows, once, for this posting. SUCCESS or an error
  // status (its message from getXferStatus): the transfer finished inside the
  // call (posted inline, see EngineConfig::inlineMaxBytes) and nothing follows.
  // checkPeer: false when the caller vouches for the peer's process itself (a
  // layered request asks peerAlive once per posting instead of once per layer:
  // on the loopback engine the check is a poll(2) on the peer's pidfd).
  // moreFollow: the caller posts more of the same batch from this thread (a
  // layered request's layers before the posting's last): a copy run inline
  // may leave its streamed stores unfenced until the batch's last post, or
  // until anything another thread or process could see (a post through the
  // engine's thread, a notification). Nothing sees them before: the batch
  // completes only with its last post.
  virtual int postXferReq(Handle req, const std::string* notif, bool mayInline = true, bool checkPeer = true,
                          bool moreFollow = false) = 0;
  // Whether the remote agent's process still runs, as far as the engine can
  // tell (true when it cannot: NIXL reports a lost peer on the transfer).
  virtual bool peerAlive(const std::string& agent) {
    (void)agent;
    return true;
  }
  // Whether the engine runs an agent's posted transfers one after another in
  // posting order, each sending its notification once its bytes are in place
  // and counting the notification's delivery in its completion: then a
  // notification given to the last of several posts goes out after all of
  // them, in order with later posts. The loopback engine does (one worker
  // thread; an inline post only when nothing is queued).
  virtual bool postsInOrder() const { return false; }
  // Forgets the notification a request was made or posted with: its next
  // postings send none until a post gives one. Not while it is in flight.
  virtual void clearNotif(Handle req) { (void)req; }
  // The bytes a request moves, if the engine knows them (UINT64_MAX if not):
  // how much copying a post of it may do inline (EngineConfig::inlineMaxBytes).
  virtual uint64_t xferBytes(Handle req) {
    (void)req;
    return UINT64_MAX;
  }
  virtual int getXferStatus(Handle req, std::string* errMsg) = 0;
  virtual void releaseXferReq(Handle req) = 0;
  virtual Telemetry getXferTelemetry(Handle req) = 0;
  // The name of the backend NIXL chose for a request (NIXL queryXferBackend).
  virtual std::string queryXferBackend(Handle req) = 0;
  struct Cost {
    uint64_t durationUs, errMarginUs;
    int method;  // nixl_cost_t
  };
  virtual Cost estimateXferCost(Handle req) = 0;

  virtual void genNotif(const std::string& agent, const std::string& msg) = 0;
  virtual void getNotifs(std::vector<std::pair<std::string, std::string>>& out) = 0;
  // JS waits for a notification: an engine that looks for them on a timer
  // looks often while this is on, since each look's delay is one hop of a
  // handshake that waits on it (push mode waits on two in a row).
  virtual void watchNotifs(bool on) { (void)on; }

  // Stops the engine's threads; no completion is reported after it returns.
  virtual void close() = 0;
};

std::unique_ptr<Engine> makeLoopbackEngine(const std::string& name, const EngineConfig& cfg, CompletionSink* sink);
#ifdef NIXL_NODE_WITH_NIXL
std::unique_ptr<Engine> makeNixlEngine(const std::string& name, const EngineConfig& cfg, CompletionSink* sink);
#endif

}  // namespace nixlnode
