// The loopback engine: NIXL's agent semantics on one host, with no library.
//  - same process: memcpy, with liveness checked against the peer's live
//    registrations;
//  - other process, memory from allocate(): the peer's memfd mapped here;
//  - other process, any other memory: process_vm_readv / process_vm_writev.
// Every descriptor is resolved against registered memory before any byte is
// touched; a request pins the regions it uses so they cannot be deregistered
// under it.
#include <fcntl.h>
#include <poll.h>
#include <sys/eventfd.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/uio.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <mutex>
#include <random>
#include <set>
#include <sstream>
#include <thread>
#include <unordered_map>

#include "../engine.h"
#include "../lookup.h"
#include "copy.h"
#include "live_table.h"
#include "metadata.h"
#include "notif_socket.h"
#include "notifier.h"
#include "shm.h"
#include "stream_copy.h"
#include "types.h"

namespace nixlnode {
namespace {

using namespace loopback;
constexpr const char* kPlugin = "LOOPBACK";

template <class Map>
typename Map::mapped_type& remoteAgent(Map& m, const std::string& agent, const char* call) {
  auto it = m.find(agent);
  if (it == m.end())
    throw EngineError(ERR_NOT_FOUND,
                      std::string(call) + ": unknown remote agent '" + agent + "' (addRemoteAgent first)");
  return it->second;
}

// Copies of at least this many bytes use streaming stores (stream_copy.h).
std::string streamCopyMinBytes() {
#ifdef NIXL_NODE_STREAM_COPY
  return std::to_string(kStreamMin);
#else
  return "off";
#endif
}

uint64_t nowEpochUs() {
  return static_cast<uint64_t>(
      std::chrono::duration_cast<std::chrono::microseconds>(std::chrono::system_clock::now().time_since_epoch())
          .count());
}

std::mutex gAgentsMu;
std::unordered_map<uint64_t, std::weak_ptr<Registry>> gAgents;  // token -> registry

class LoopbackEngine final : public Engine {
 public:
  LoopbackEngine(const std::string& name, const EngineConfig& cfg, CompletionSink* sink)
      : name_(name), cfg_(cfg), sink_(sink), registry_(std::make_shared<Registry>()) {
    if (name.empty()) throw EngineError(ERR_INVALID_PARAM, "agent name must not be empty");
    std::random_device rd;
    token_ = (static_cast<uint64_t>(rd()) << 32) ^ rd() ^ reinterpret_cast<uint64_t>(this);
    bootId_ = loopback::bootId();
    startTime_ = loopback::processStartTime(static_cast<uint32_t>(getpid()));
    handles_.start(cfg.testFirstHandle);
    for (const auto& b : cfg.backends) createBackend(b, {});
    agentSlot_ = live_.acquire();  // slot 0: the agent itself, dead once closed
    wakeFd_ = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
    {
      std::lock_guard<std::mutex> lk(gAgentsMu);
      gAgents[token_] = registry_;
    }
    notifier_ = std::make_unique<loopback::Notifier>(sock_, name_);
    worker_ = std::thread([this] { workLoop(); });
    receiver_ = std::thread([this] { receiveLoop(); });
  }

  ~LoopbackEngine() override { close(); }

  const char* kind() const override { return "loopback"; }

  std::vector<std::string> getPluginList() override { return {kPlugin}; }

  PluginInfo getPluginParams(const std::string& plugin) override {
    checkPlugin(plugin);
    return PluginInfo{{}, {MemType::DRAM}};
  }

  void createBackend(const std::string& plugin, const Params&) override {
    checkPlugin(plugin);
    if (backendCreated_) throw EngineError(ERR_NOT_ALLOWED, "backend " + plugin + " already created");
    backendCreated_ = true;
  }

  std::vector<std::string> getBackends() override {
    if (backendCreated_) return {kPlugin};
    return {};
  }

  // What this backend runs with: nothing here is configurable, so these are
  // the fixed facts of its data path, as NIXL reports a backend's defaults.
  PluginInfo getBackendParams(const std::string& backend) override {
    checkOpen();
    checkPlugin(backend);
    if (!backendCreated_)
      throw EngineError(ERR_NOT_FOUND, "getBackendParams: backend '" + backend + "' was not created");
    Params p{
        {"paths", "same-process memcpy, peer memfd mapping (allocate()), process_vm_readv/writev"},
        {"worker_threads", "1"},
        {"max_notif_bytes", std::to_string(NotifSocket::kMaxMsg)},
        {"stream_copy_min_bytes", streamCopyMinBytes()},
        {"capture_telemetry", cfg_.captureTelemetry ? "true" : "false"},
        {"hosts", "this host only"},
    };
    return PluginInfo{std::move(p), {MemType::DRAM}};
  }

  Handle registerMem(const std::vector<Desc>& descs, MemType type, const std::vector<std::string>& backends) override {
    checkOpen();
    handles_.check("registerMem");
    checkBackends(backends);
    checkType(type);
    if (descs.empty()) throw EngineError(ERR_INVALID_PARAM, "registerMem: empty descriptor list");
    for (const auto& d : descs)
      if (d.addr == 0 || d.len == 0 || descWraps(d.addr, d.len))
        throw EngineError(ERR_INVALID_PARAM, "registerMem: invalid descriptor " + descStr(d));
    long bad = loopback::firstUnmapped(descs);
    if (bad >= 0)
      throw EngineError(ERR_INVALID_PARAM,
                        "registerMem: " + descStr(descs[bad]) + " is not readable and writable memory of this process");
    std::vector<RegionP> regs;
    std::vector<uint32_t> slots;
    for (const auto& d : descs) {
      // One liveness slot per range: it records the range, so peers bound what metadata claims by it.
      LiveTable::Slot slot;
      try {
        slot = live_.acquire(d.addr, d.len);
      } catch (...) {
        for (uint32_t s : slots) live_.kill(s);
        throw;
      }
      slots.push_back(slot.index);
      auto r = std::make_shared<Region>();
      r->d = d;
      r->type = type;
      r->liveSlot = slot;
      shm::lookup(d.addr, d.len, &r->shm) || (r->shm.fd = -1, true);
      regs.push_back(std::move(r));
    }
    {
      std::lock_guard<std::mutex> lk(registry_->mu);
      auto& v = registry_->regions;
      for (auto& r : regs) {
        auto pos =
            std::upper_bound(v.begin(), v.end(), r->d.addr, [](uint64_t a, const RegionP& x) { return a < x->d.addr; });
        v.insert(pos, r);
      }
    }
    Handle h = handles_.take("registerMem");
    registrations_[h] = Registration{std::move(regs), std::move(slots)};
    return h;
  }

  void deregisterMem(Handle reg) override {
    checkOpen();
    Registration& registration = lookup(registrations_, reg, "deregisterMem", "memory registration");
    std::lock_guard<std::mutex> lk(registry_->mu);
    for (auto& r : registration.regions) {
      int n = r->inUse.load();
      if (n > 0)
        throw EngineError(ERR_NOT_ALLOWED, "deregisterMem: " + descStr(r->d) + " is in use by " + std::to_string(n) +
                                               " in-flight transfer(s); wait for them or release them first");
    }
    auto& v = registry_->regions;
    for (auto& r : registration.regions) {
      r->live = false;
      v.erase(std::remove(v.begin(), v.end(), r), v.end());
    }
    // Peers in other processes see it before the caller can reuse the memory.
    for (uint32_t s : registration.slots) live_.kill(s);
    registrations_.erase(reg);
  }

  std::string getLocalMD() override {
    checkOpen();
    std::lock_guard<std::mutex> lk(registry_->mu);
    return encodeMd(registry_->regions, false, true);
  }

  std::string getLocalPartialMD(const std::vector<Desc>& descs, MemType type, bool includeConnInfo,
                                const std::vector<std::string>& backends) override {
    checkOpen();
    checkBackends(backends);
    std::vector<RegionP> picked;
    std::lock_guard<std::mutex> lk(registry_->mu);
    for (const auto& d : descs) {
      RegionP r = registry_->find(d, type);
      if (!r) throw EngineError(ERR_NOT_FOUND, "getLocalPartialMD: " + descStr(d) + " is not registered");
      if (std::find(picked.begin(), picked.end(), r) == picked.end()) picked.push_back(r);
    }
    return encodeMd(picked, true, includeConnInfo);
  }

  std::string loadRemoteMD(const std::string& blob) override {
    checkOpen();
    loopback::AgentMd md = loopback::decode(blob);
    if (md.name == name_) throw EngineError(ERR_NOT_ALLOWED, "loadRemoteMD: that is this agent's own metadata");
    auto known = remotes_.find(md.name);
    if (known != remotes_.end()) {
      // As NIXL: partial metadata adds registrations to a known agent; full
      // metadata does not silently replace it (its handles would go stale).
      if (!md.partial)
        throw EngineError(ERR_NOT_ALLOWED,
                          "loadRemoteMD: agent '" + md.name + "' is already loaded (removeRemoteAgent first)");
      addRegions(*known->second, md);
      return md.name;
    }
    if (!md.connInfo)
      throw EngineError(ERR_NOT_FOUND, "loadRemoteMD: partial metadata of unknown agent '" + md.name +
                                           "' has no connection info (load its full metadata first)");
    if (md.bootId != bootId_)
      throw EngineError(ERR_NOT_SUPPORTED, "agent " + md.name +
                                               " runs on another host: the loopback engine connects agents on one "
                                               "host only (install NIXL for RDMA/TCP between hosts)");
    auto ra = std::make_shared<RemoteAgent>();
    ra->name = md.name;
    ra->pid = md.pid;
    ra->notifAddr = md.notifAddr;
    if (md.pid == static_cast<uint32_t>(getpid())) {
      std::lock_guard<std::mutex> lk(gAgentsMu);
      auto it = gAgents.find(md.token);
      if (it == gAgents.end() || it->second.expired())
        throw EngineError(ERR_REMOTE_DISCONNECT, "agent " + md.name + " is closed");
      ra->sameProcess = true;
      ra->registry = it->second;
    } else {
      ra->pidfd = static_cast<int>(syscall(SYS_pidfd_open, md.pid, 0));
      ra->startTime = md.startTime;
      uint64_t st = loopback::processStartTime(md.pid);
      if (st == 0 || st != md.startTime)
        throw EngineError(ERR_REMOTE_DISCONNECT,
                          "agent " + md.name + " (pid " + std::to_string(md.pid) + ") is no longer running");
      ra->live = std::make_unique<loopback::LiveView>(md.pid, md.liveFd, md.liveIno);
      ra->agentWord = md.agentWord;
      if (!ra->live->alive(0, md.agentWord))
        throw EngineError(ERR_REMOTE_DISCONNECT, "agent " + md.name + " is closed");
    }
    addRegions(*ra, md);
    remotes_[md.name] = ra;
    return md.name;
  }

  void invalidateRemoteMD(const std::string& agent) override {
    checkOpen();
    remoteAgent(remotes_, agent, "removeRemoteAgent")->removed = true;
    remotes_.erase(agent);
  }

  void sendLocalMD(const std::string&, int) override { noMetadataService("sendLocalMD"); }
  void sendLocalPartialMD(const std::vector<Desc>&, MemType, bool, const std::vector<std::string>&, const std::string&,
                          int, const std::string&) override {
    noMetadataService("sendLocalPartialMD");
  }
  void fetchRemoteMD(const std::string&, const std::string&, int, const std::string&) override {
    noMetadataService("fetchRemoteMD");
  }
  void invalidateLocalMD(const std::string&, int) override { noMetadataService("invalidateLocalMD"); }

  bool checkRemoteMD(const std::string& agent, const std::vector<Desc>& descs, MemType type) override {
    checkOpen();
    auto it = remotes_.find(agent);
    if (it == remotes_.end()) return false;
    const RemoteAgent& ra = *it->second;
    for (const auto& d : descs)
      if (!ra.find(d, type)) return false;  // not in what its metadata told us
    if (ra.sameProcess) {
      auto reg = ra.registry.lock();
      if (!reg) return false;
      std::lock_guard<std::mutex> lk(reg->mu);
      for (const auto& d : descs)
        if (!reg->find(d, type)) return false;  // and still registered
    }
    return true;
  }

  void makeConnection(const std::string& agent) override {
    checkOpen();
    if (!remoteAgent(remotes_, agent, "makeConnection")->processAlive())
      throw EngineError(ERR_REMOTE_DISCONNECT, "makeConnection: agent '" + agent + "' is gone");
  }

  std::vector<std::optional<Params>> queryMem(const std::vector<Desc>& descs, MemType type,
                                              const std::vector<std::string>& backends) override {
    checkOpen();
    checkBackends(backends);
    checkType(type);
    std::vector<std::optional<Params>> out;
    std::lock_guard<std::mutex> lk(registry_->mu);
    for (const auto& d : descs) {
      if (registry_->find(d, type))
        out.push_back(Params{{"registered", "true"}});
      else
        out.push_back(std::nullopt);
    }
    return out;
  }

  Cost estimateXferCost(Handle) override {
    checkOpen();
    throw EngineError(ERR_NOT_SUPPORTED, "estimateXferCost: the loopback engine has no cost model");
  }

  Handle prepXferDlist(const std::string& agent, const std::vector<Desc>& descs, MemType type,
                       const std::vector<std::string>& backends) override {
    checkOpen();
    checkBackends(backends);
    auto dl = std::make_shared<Dlist>(buildDlist(agent, descs, type));
    Handle h = handles_.take("prepXferDlist");
    dlists_[h] = std::move(dl);
    return h;
  }

  void releaseDlist(Handle h) override {
    checkOpen();
    if (dlists_.erase(h) == 0)
      throw EngineError(ERR_NOT_FOUND, "releaseDlistHandle: unknown or already released handle");
  }

  Handle makeXferReq(XferOp op, Handle localH, const uint32_t* li, size_t nl, Handle remoteH, const uint32_t* ri,
                     size_t nr, const std::string* notif) override {
    checkOpen();
    handles_.check("makeXferReq");
    const Dlist& L = *lookup(dlists_, localH, "makeXferReq", "local descriptor list handle");
    const Dlist& R = *lookup(dlists_, remoteH, "makeXferReq", "remote descriptor list handle");
    if (L.remote)
      throw EngineError(ERR_INVALID_PARAM, "makeXferReq: the local side must be a dlist prepared for the local agent");
    if (!R.remote)
      throw EngineError(ERR_INVALID_PARAM, "makeXferReq: the remote side must be a dlist prepared for a remote agent");
    if (nl != nr)
      throw EngineError(ERR_INVALID_PARAM,
                        "makeXferReq: " + std::to_string(nl) + " local vs " + std::to_string(nr) + " remote indices");
    std::vector<Entry> le, re;
    le.reserve(nl);
    re.reserve(nr);
    for (size_t i = 0; i < nl; ++i) {
      if (li[i] >= L.entries.size() || ri[i] >= R.entries.size())
        throw EngineError(ERR_INVALID_PARAM, "makeXferReq: index out of range at position " + std::to_string(i));
      le.push_back(L.entries[li[i]]);
      re.push_back(R.entries[ri[i]]);
    }
    return newRequest(op, R.remote, std::move(le), std::move(re), notif);
  }

  Handle createXferReq(XferOp op, const std::vector<Desc>& local, MemType lt, const std::vector<Desc>& remote,
                       MemType rt, const std::string& agent, const std::string* notif) override {
    checkOpen();
    handles_.check("createXferReq");
    if (agent.empty()) throw EngineError(ERR_INVALID_PARAM, "createXferReq: remote agent name is empty");
    if (local.size() != remote.size())
      throw EngineError(ERR_INVALID_PARAM, "createXferReq: " + std::to_string(local.size()) + " local vs " +
                                               std::to_string(remote.size()) + " remote descriptors");
    Dlist L = buildDlist("", local, lt);
    Dlist R = buildDlist(agent, remote, rt);
    return newRequest(op, R.remote, std::move(L.entries), std::move(R.entries), notif);
  }

  int postXferReq(Handle h, const std::string* notif, bool mayInline, bool checkPeer, bool moreFollow) override {
    checkOpen();
    // A reference: nothing in this call changes requests_, and a copy would cost two atomics per post.
    const RequestP& req = request(h, "postXferReq");
    if (req->status.load(std::memory_order_acquire) == IN_PROG)
      throw EngineError(ERR_REPOST_ACTIVE, "postXferReq: transfer is still in progress");
    if (req->remote->removed)
      throw EngineError(ERR_NOT_FOUND, "postXferReq: remote agent '" + req->remote->name + "' was removed");
    if (notif) {
      if (notif->size() > NotifSocket::kMaxMsg) throw EngineError(ERR_INVALID_PARAM, "notification larger than 64 KiB");
      req->hasNotif = true;
      req->notif = *notif;
    }
    // Telemetry's clocks only when asked for: a layer-wise sender posts many small requests.
    const bool tel = cfg_.captureTelemetry;
    auto t0 = tel ? Clock::now() : Clock::time_point{};
    // A small copy costs less than the worker's wake-up and the completion's
    // way back: run it here, as NIXL's UCX cma does inside postXferReq. Only
    // when the worker has nothing queued or running, so no transfer or
    // notification overtakes one posted before it.
    const bool inl = mayInline && postInline(*req);
    // Throws if memory went away since the handle was made. A copy run inline
    // needs no pin on this agent's own memory: only this thread deregisters it.
    pin(*req, !inl);
    req->checkPeer = checkPeer;
    // A layer-wise sender's next post follows at once: its streamed stores
    // need no fence of their own before the last post's (copy.h).
    req->deferFence = inl && moreFollow && !req->hasNotif;
    req->err.clear();
    if (tel) req->tel = Telemetry{nowEpochUs(), 0, 0, req->totalBytes, req->local.size()};
    req->postedAt = t0;
    // Release, not seq_cst: a seq_cst store is a locked instruction, which
    // waits for the last inline copy's streamed stores to reach memory.
    req->status.store(IN_PROG, std::memory_order_release);
    if (inl) {
      int s = execute(req, false);
      // A post that failed before its copy fenced nothing: fence here.
      if (req->deferFence)
        unfenced_ = true;
      else
        fenceInlineCopies();
      req->tel.postDurationUs = req->tel.xferDurationUs;
      return s;
    }
    fenceInlineCopies();  // the worker's copies and reports must not overtake this thread's stores
    busy_.fetch_add(1, std::memory_order_relaxed);
    {
      std::lock_guard<std::mutex> lk(qMu_);
      queue_.push_back(req);
    }
    qCv_.notify_one();
    if (tel)
      req->tel.postDurationUs =
          static_cast<uint64_t>(std::chrono::duration_cast<std::chrono::microseconds>(Clock::now() - t0).count());
    return IN_PROG;
  }

  // Inline copies that left their streamed stores unfenced (a layer-wise
  // sender's, with more posts to follow) are fenced before anything another
  // thread or process could see: a post through the worker, a notification.
  void fenceInlineCopies() {
    if (!unfenced_) return;
    streamFence();
    unfenced_ = false;
  }

  int getXferStatus(Handle h, std::string* errMsg) override {
    checkOpen();
    const Request& req = *request(h, "checkXferState");
    int s = req.status.load(std::memory_order_acquire);
    if (s < 0 && errMsg) *errMsg = req.err;
    return s;
  }

  void releaseXferReq(Handle h) override {
    checkOpen();
    // An in-flight request finishes (or is skipped, if still queued) on the
    // worker, which holds its own reference; the handle is gone at once.
    request(h, "releaseXferHandle")->released = true;
    if (RecentRequest& c = recent_[h % kRecent]; c.h == h) c = {};
    requests_.erase(h);
  }

  Telemetry getXferTelemetry(Handle h) override {
    checkOpen();
    const Request& req = *lookup(requests_, h, "getXferTelemetry", "transfer handle");
    if (!cfg_.captureTelemetry)
      throw EngineError(ERR_NO_TELEMETRY, "telemetry is off: create the agent with captureTelemetry: true");
    if (req.status.load(std::memory_order_acquire) == ERR_NOT_POSTED)
      throw EngineError(ERR_NO_TELEMETRY, "transfer was never posted");
    return req.tel;
  }

  std::string queryXferBackend(Handle h) override {
    checkOpen();
    lookup(requests_, h, "queryXferBackend", "transfer handle");
    return kPlugin;  // the only backend a loopback agent has
  }

  uint64_t xferBytes(Handle h) override {
    checkOpen();
    return lookup(requests_, h, "xferBytes", "transfer handle")->totalBytes;
  }

  bool postsInOrder() const override { return true; }

  void clearNotif(Handle h) override {
    checkOpen();
    const RequestP& req = lookup(requests_, h, "clearNotif", "transfer handle");
    if (req->status.load() == IN_PROG)
      throw EngineError(ERR_REPOST_ACTIVE, "clearNotif: transfer is still in progress");
    req->hasNotif = false;
    req->notif.clear();
  }

  bool peerAlive(const std::string& agent) override {
    checkOpen();
    auto it = remotes_.find(agent);
    return it == remotes_.end() || it->second->processAlive();
  }

  void genNotif(const std::string& agent, const std::string& msg) override {
    checkOpen();
    const RemoteP& ra = remoteAgent(remotes_, agent, "genNotif");
    fenceInlineCopies();
    if (msg.size() > NotifSocket::kMaxMsg) throw EngineError(ERR_INVALID_PARAM, "notification larger than 64 KiB");
    // A full peer queue queues it on the notifier (delivered later, in order).
    int e = notifier_->send(ra->notifAddr, msg, nullptr);
    if (e != 0 && e != EINPROGRESS) {
      throw EngineError(ERR_REMOTE_DISCONNECT,
                        "genNotif to '" + agent + "': " + std::string(strerror(e)) + " (agent gone?)");
    }
  }

  void getNotifs(std::vector<std::pair<std::string, std::string>>& out) override {
    checkOpen();
    std::lock_guard<std::mutex> lk(nMu_);
    if (out.empty()) {
      out.swap(notifs_);
    } else {
      for (auto& n : notifs_) out.push_back(std::move(n));
      notifs_.clear();
    }
  }

  void close() override {
    if (closed_) return;
    closed_ = true;
    fenceInlineCopies();
    {
      std::lock_guard<std::mutex> lk(qMu_);
      stopping_ = true;
    }
    qCv_.notify_all();
    uint64_t one = 1;
    if (write(wakeFd_, &one, sizeof one) < 0) { /* the loop also polls with a timeout */
    }
    if (worker_.joinable()) worker_.join();
    if (receiver_.joinable()) receiver_.join();
    notifier_->stop();  // queued notifications of unfinished requests are dropped
    ::close(wakeFd_);
    live_.killAll();  // peers in other processes refuse our memory from now on
    {
      std::lock_guard<std::mutex> lk(gAgentsMu);
      gAgents.erase(token_);
    }
    for (auto& req : queue_) unpin(*req);  // posted, never run (released ones too)
    queue_.clear();
    recent_.fill({});
    requests_.clear();
    dlists_.clear();
    for (auto& [n, r] : remotes_) r->removed = true;
    remotes_.clear();
    registrations_.clear();
    // Same-process peers: no new copy starts on our memory, and the ones
    // running finish before the addon lets the JS memory go.
    std::unique_lock<std::mutex> lk(registry_->mu);
    for (auto& r : registry_->regions) r->live = false;
    registry_->regions.clear();
    registry_->idle.wait(lk, [this] { return registry_->copying == 0; });
  }

 private:
  // requests_'s entry for h through recent_ (a hit: an index and a compare,
  // no hash): a layer-wise sender posts the same few requests over and over.
  RequestP& request(Handle h, const char* call) {
    RecentRequest& c = recent_[h % kRecent];
    if (c.h == h) return *c.req;
    RequestP& r = lookup(requests_, h, call, "transfer handle");
    c = {h, &r};
    return r;
  }

  void checkOpen() const {
    if (closed_) throw EngineError(ERR_NOT_ALLOWED, "agent '" + name_ + "' is closed");
  }
  static void checkPlugin(const std::string& p) {
    if (p != kPlugin)
      throw EngineError(ERR_NOT_FOUND, "plugin '" + p + "' not found: the loopback engine offers LOOPBACK only");
  }
  void checkBackends(const std::vector<std::string>& b) const {
    for (const auto& n : b) checkPlugin(n);
    if (!backendCreated_) throw EngineError(ERR_NOT_FOUND, "no backend created (createBackend('LOOPBACK') first)");
  }
  static void checkType(MemType t) {
    if (t != MemType::DRAM)
      throw EngineError(ERR_NOT_SUPPORTED,
                        "the loopback engine handles DRAM only; VRAM, block, object and file "
                        "memory need the NIXL engine");
  }

  [[noreturn]] static void noMetadataService(const char* what) {
    throw EngineError(ERR_NOT_SUPPORTED, std::string(what) +
                                             ": the loopback engine has no NIXL metadata listener or etcd; exchange "
                                             "getAgentMetadata() yourself or use nixl-node's handshake module");
  }

  // Caller holds registry_->mu.
  std::string encodeMd(const std::vector<RegionP>& regions, bool partial, bool connInfo) const {
    loopback::AgentMd md;
    md.partial = partial;
    md.connInfo = connInfo;
    md.name = name_;
    md.bootId = bootId_;
    md.pid = static_cast<uint32_t>(getpid());
    md.startTime = startTime_;
    md.token = token_;
    md.notifAddr = sock_.address();
    md.liveFd = live_.fd();
    md.liveIno = live_.ino();
    md.agentWord = agentSlot_.word;
    for (const auto& r : regions) {
      md.regions.push_back(loopback::MdRegion{r->d.addr, r->d.len, r->d.devId, r->type, r->shm.fd, r->shm.offset,
                                              r->shm.size, r->shm.ino, r->liveSlot.index, r->liveSlot.word});
    }
    return loopback::encode(md);
  }

  void addRegions(RemoteAgent& ra, const loopback::AgentMd& md) {
    // Another process's metadata says what it registered; its liveness table
    // says what it really did. Nothing of a tampered claim is loaded.
    if (!ra.sameProcess)
      for (const auto& g : md.regions) {
        uint64_t reg[2] = {0, 0};
        if (ra.live->covers(g.liveSlot, g.liveWord, g.addr, g.len, reg)) continue;
        if (!ra.live->alive(g.liveSlot, g.liveWord))
          throw EngineError(ERR_NOT_FOUND, "loadRemoteMD: agent '" + md.name + "' no longer registers " +
                                               descStr(Desc{g.addr, g.len, g.devId}) + " (deregistered since)");
        throw EngineError(ERR_MISMATCH, "loadRemoteMD: the metadata of agent '" + md.name + "' claims " +
                                            descStr(Desc{g.addr, g.len, g.devId}) + ", but it registered " +
                                            descStr(Desc{reg[0], reg[1], g.devId}) + " (tampered metadata?)");
      }
    for (const auto& g : md.regions) {
      RemoteRegion rr{g, {}, nullptr};
      if (!ra.sameProcess && g.shmFd >= 0) {
        // Falls back to process_vm_* when the memfd cannot be mapped.
        if (shm::mapPeer(ra.pid, g.shmFd, g.shmIno, g.shmOffset, g.len, &rr.mapping)) rr.mapped = rr.mapping.at;
      }
      ra.regions.push_back(rr);
    }
    std::sort(ra.regions.begin(), ra.regions.end(),
              [](const RemoteRegion& a, const RemoteRegion& b) { return a.r.addr < b.r.addr; });
  }

  Dlist buildDlist(const std::string& agent, const std::vector<Desc>& descs, MemType type) {
    checkType(type);
    Dlist dl;
    dl.type = type;
    dl.entries.reserve(descs.size());
    if (agent.empty()) {
      std::lock_guard<std::mutex> lk(registry_->mu);
      for (const auto& d : descs) {
        RegionP r = d.len ? registry_->find(d, type) : nullptr;
        if (!r)
          throw EngineError(ERR_NOT_FOUND,
                            "descriptor " + descStr(d) + " is not inside memory registered with agent '" + name_ + "'");
        dl.entries.push_back(Entry{d, r, reinterpret_cast<char*>(d.addr)});
      }
      return dl;
    }
    dl.remote = remoteAgent(remotes_, agent, "prepXferDlist");
    const RemoteAgent& ra = *dl.remote;
    if (ra.sameProcess) {
      auto reg = ra.registry.lock();
      if (!reg) throw EngineError(ERR_REMOTE_DISCONNECT, "agent '" + agent + "' is closed");
      std::lock_guard<std::mutex> lk(reg->mu);
      for (const auto& d : descs) {
        // Only memory its metadata announced, and only while still registered.
        RegionP r = d.len && ra.find(d, type) ? reg->find(d, type) : nullptr;
        if (!r)
          throw EngineError(ERR_NOT_FOUND,
                            "descriptor " + descStr(d) + " is not inside memory registered with agent '" + agent + "'");
        dl.entries.push_back(Entry{d, r, reinterpret_cast<char*>(d.addr)});
      }
      return dl;
    }
    for (const auto& d : descs) {
      const RemoteRegion* r = d.len ? ra.find(d, type) : nullptr;
      if (!r)
        throw EngineError(ERR_NOT_FOUND, "descriptor " + descStr(d) + " is not inside memory agent '" + agent +
                                             "' registered (as of its last metadata)");
      char* p = r->mapped ? r->mapped + (d.addr - r->r.addr) : nullptr;
      dl.entries.push_back(Entry{d, nullptr, p, r->r.liveSlot, r->r.liveWord});
    }
    return dl;
  }

  Handle newRequest(XferOp op, RemoteP remote, std::vector<Entry> le, std::vector<Entry> re, const std::string* notif) {
    if (le.empty()) throw EngineError(ERR_INVALID_PARAM, "transfer request with no descriptors");
    auto req = std::make_shared<Request>();
    for (size_t i = 0; i < le.size(); ++i) {
      if (le[i].d.len != re[i].d.len)
        throw EngineError(ERR_INVALID_PARAM, "descriptor " + std::to_string(i) + ": local length " +
                                                 std::to_string(le[i].d.len) + " != remote length " +
                                                 std::to_string(re[i].d.len));
      req->totalBytes += le[i].d.len;
    }
    if (notif) {
      if (notif->size() > NotifSocket::kMaxMsg) throw EngineError(ERR_INVALID_PARAM, "notification larger than 64 KiB");
      req->hasNotif = true;
      req->notif = *notif;
    }
    req->op = op;
    req->remote = std::move(remote);
    req->localOneRegion =
        std::all_of(le.begin(), le.end(), [&](const Entry& e) { return e.region == le.front().region; });
    for (const Entry& e : le) req->pages.add(e.d.addr, e.d.len);
    req->local = std::move(le);
    req->viaSyscall = std::any_of(re.begin(), re.end(), [](const Entry& e) { return e.ptr == nullptr; });
    req->remote_ = std::move(re);
    if (!req->remote->sameProcess) {
      // (slot, word) pairs seen: a reused slot has a new word. A request
      // touches few registrations, so a linear look through those found so
      // far beats a tree (whose nodes cost an allocation each) until many.
      constexpr size_t kLinear = 16;
      std::set<std::pair<uint32_t, uint64_t>> many;
      for (size_t i = 0; i < req->remote_.size(); ++i) {
        const Entry& e = req->remote_[i];
        bool fresh;
        if (req->liveChecks.size() < kLinear) {
          fresh = std::none_of(req->liveChecks.begin(), req->liveChecks.end(), [&](size_t j) {
            return req->remote_[j].liveSlot == e.liveSlot && req->remote_[j].liveWord == e.liveWord;
          });
        } else {
          if (many.empty())
            for (size_t j : req->liveChecks) many.emplace(req->remote_[j].liveSlot, req->remote_[j].liveWord);
          fresh = many.emplace(e.liveSlot, e.liveWord).second;
        }
        if (fresh) req->liveChecks.push_back(i);
      }
    }
    req->id = handles_.take("transfer request");
    requests_[req->id] = req;
    return req->id;
  }

  // Pins every region the request touches; fails (pinning nothing) if one was
  // deregistered or its agent closed. pinLocal false (a copy run inline, on
  // the JS thread that alone deregisters this agent's memory): this agent's
  // regions are only checked, with no lock and no atomic (they are written on
  // this thread only); a same-process peer's are pinned all the same (its
  // agent may live on another thread).
  void pin(Request& req, bool pinLocal) {
    auto pinSide = [&](std::vector<Entry>& es, Registry& reg, const std::string& who) {
      std::lock_guard<std::mutex> lk(reg.mu);
      checkLive(es, who);
      addInUse(es, 1);
    };
    if (pinLocal)
      pinSide(req.local, *registry_, name_);
    else if (req.localOneRegion)
      checkLive(req.local.front(), name_);  // a layer's blocks mostly lie in one registration
    else
      checkLive(req.local, name_);
    if (req.remote->sameProcess) {
      auto reg = req.remote->registry.lock();
      if (!reg) {
        if (pinLocal) unpinSide(req.local);
        throw EngineError(ERR_REMOTE_DISCONNECT, "agent '" + req.remote->name + "' is closed");
      }
      try {
        pinSide(req.remote_, *reg, req.remote->name);
      } catch (...) {
        if (pinLocal) unpinSide(req.local);
        throw;
      }
    }
    req.pinned = true;
    req.pinnedLocal = pinLocal;
  }
  static void checkLive(const std::vector<Entry>& es, const std::string& who) {
    for (const auto& e : es) checkLive(e, who);
  }
  static void checkLive(const Entry& e, const std::string& who) {
    if (!e.region->live)
      throw EngineError(ERR_NOT_FOUND, "memory " + descStr(e.d) + " of agent '" + who + "' was deregistered");
  }
  static void unpinSide(std::vector<Entry>& es) { addInUse(es, -1); }
  // One atomic per run of entries in the same region, not one per entry: the
  // blocks of a request mostly share a registration, and a small request's
  // post is dominated by these read-modify-writes otherwise.
  static void addInUse(std::vector<Entry>& es, int sign) {
    for (size_t i = 0; i < es.size();) {
      Region* r = es[i].region.get();
      size_t j = i + 1;
      while (j < es.size() && es[j].region.get() == r) ++j;
      if (r) r->inUse.fetch_add(sign * static_cast<int>(j - i), std::memory_order_relaxed);
      i = j;
    }
  }
  static void unpin(Request& req) {
    if (!req.pinned) return;
    req.pinned = false;
    if (req.pinnedLocal) unpinSide(req.local);
    if (req.remote->sameProcess) unpinSide(req.remote_);  // another process's regions are never pinned here
  }

  // No lock: only this thread queues work, so an idle worker stays idle
  // until this thread queues more (the acquire pairs with workerDone).
  bool postInline(const Request& req) const {
    if (cfg_.testDelayUs) return false;
    // Its own last copy's time, or, never timed, what its peer's last timed copy predicts.
    uint32_t us =
        expectedPostUs(cfg_, req.op, req.totalBytes, req.local.size(), req.copyUs.load(std::memory_order_relaxed),
                       req.remote->rate[req.viaSyscall], req.pages);
    if (!inlineAllowed(cfg_, req.totalBytes, us)) return false;
    return busy_.load(std::memory_order_acquire) == 0;
  }

  void workLoop() {
    for (;;) {
      RequestP req;
      {
        std::unique_lock<std::mutex> lk(qMu_);
        qCv_.wait(lk, [this] { return stopping_ || !queue_.empty(); });
        if (stopping_) return;
        req = std::move(queue_.front());
        queue_.pop_front();
      }
      if (cfg_.testDelayUs) std::this_thread::sleep_for(std::chrono::microseconds(cfg_.testDelayUs));
      execute(req, true);
    }
  }

  // Runs a pinned request: the worker's (report: the sink hears of it) or one
  // posted inline (it does not: the post returns the status). Returns the
  // final status, or IN_PROG when its notification waits in the notifier's
  // queue (which finishes it, and reports it, once the notification is out).
  int execute(const RequestP& reqp, bool report) {
    Request& req = *reqp;
    std::string err;
    int status = SUCCESS;
    if (req.released) {
      status = ERR_CANCELED;
      err = "released before it ran";
    } else if (req.checkPeer && !req.remote->processAlive()) {
      status = ERR_REMOTE_DISCONNECT;
      err = "agent '" + req.remote->name + "' is gone (process exited or agent closed)";
    } else if (req.totalBytes > cfg_.inlineMaxBytes) {
      // Timed, so that the next post of it, or a new request's first post to
      // its peer, can choose its thread (inlineAllowed).
      auto t0 = Clock::now();
      status = copyRequest(req, &err);
      uint32_t us = postUsSince(t0);
      req.copyUs.store(us, std::memory_order_relaxed);
      if (status == SUCCESS) req.remote->rate[req.viaSyscall].record(req.totalBytes, req.local.size(), us);
    } else {
      status = copyRequest(req, &err);
    }
    unpin(req);
    if (status == SUCCESS && req.hasNotif) {
      // The request completes once its notification is out. A peer whose
      // queue is full delays only its own requests, never this worker.
      int e = notifier_->send(req.remote->notifAddr, req.notif, [this, reqp](int e) {
        finish(*reqp, e == 0 ? SUCCESS : ERR_REMOTE_DISCONNECT, notifError(*reqp, e), true);
      });
      if (e != 0 && e != EINPROGRESS) {
        status = ERR_REMOTE_DISCONNECT;
        err = notifError(req, e);
      }
      if (report) workerDone();
      if (e == EINPROGRESS) return IN_PROG;
    } else if (report) {
      workerDone();
    }
    finish(req, status, err, report);
    return status;
  }

  // The worker's request has moved its bytes and handed over its notification:
  // from here nothing of it can be overtaken, so a post may go inline again
  // (before the completion is reported, which is what JS waits for).
  void workerDone() { busy_.fetch_sub(1, std::memory_order_release); }

  static std::string notifError(const Request& req, int e) {
    if (e == 0) return {};
    return "data moved, but the notification to '" + req.remote->name +
           "' failed: " + (e == ETIMEDOUT ? "its queue stayed full for 5 s" : strerror(e));
  }

  void finish(Request& req, int status, const std::string& err, bool report) {
    if (cfg_.captureTelemetry)
      req.tel.xferDurationUs = static_cast<uint64_t>(
          std::chrono::duration_cast<std::chrono::microseconds>(Clock::now() - req.postedAt).count());
    req.err = err;
    req.status.store(status, std::memory_order_release);
    if (report) sink_->onComplete(req.id);
  }

  void receiveLoop() {
    std::string from, msg;
    for (;;) {
      pollfd p[2] = {{sock_.fd(), POLLIN, 0}, {wakeFd_, POLLIN, 0}};
      int r = poll(p, 2, 1000);
      if (closed_) return;
      if (r <= 0) continue;
      bool got = false;
      {
        std::lock_guard<std::mutex> lk(nMu_);
        while (sock_.recv(&from, &msg)) {
          notifs_.emplace_back(std::move(from), std::move(msg));
          got = true;
        }
      }
      if (got) sink_->onNotif();
    }
  }

  const std::string name_;
  const EngineConfig cfg_;
  CompletionSink* sink_;
  std::shared_ptr<Registry> registry_;
  uint64_t token_ = 0;
  std::string bootId_;
  uint64_t startTime_ = 0;
  bool backendCreated_ = false;
  std::atomic<bool> closed_{false};

  NotifSocket sock_;
  loopback::LiveTable live_;
  loopback::LiveTable::Slot agentSlot_{0, 0};
  std::unique_ptr<loopback::Notifier> notifier_;
  HandleCounter handles_;
  struct Registration {
    std::vector<RegionP> regions;
    std::vector<uint32_t> slots;  // in live_, one per region
  };
  std::unordered_map<Handle, Registration> registrations_;
  std::unordered_map<Handle, std::shared_ptr<Dlist>> dlists_;
  std::unordered_map<Handle, RequestP> requests_;
  // The entries of requests_ looked up last, by handle modulo kRecent: an
  // unordered_map's entries stay put until erased (a rehash moves none), and
  // releaseXferReq and close drop what they erase. Handles are never reused
  // (HandleCounter refuses rather than wraps).
  static constexpr Handle kRecent = 128;
  struct RecentRequest {
    Handle h = 0;  // 0: empty (handles count from 1)
    RequestP* req = nullptr;
  };
  std::array<RecentRequest, kRecent> recent_{};
  std::unordered_map<std::string, RemoteP> remotes_;

  std::mutex qMu_;
  std::condition_variable qCv_;
  std::deque<RequestP> queue_;
  // Requests queued or running on the worker, until workerDone: a post may go
  // inline only at 0. Written by both threads, read by the JS thread.
  std::atomic<uint32_t> busy_{0};
  bool unfenced_ = false;  // JS thread only: see fenceInlineCopies
  bool stopping_ = false;
  std::thread worker_;

  int wakeFd_ = -1;
  std::mutex nMu_;
  std::vector<std::pair<std::string, std::string>> notifs_;
  std::thread receiver_;
};

}  // namespace

std::unique_ptr<Engine> makeLoopbackEngine(const std::string& name, const EngineConfig& cfg, CompletionSink* sink) {
  return std::make_unique<LoopbackEngine>(name, cfg, sink);
}

}  // namespace nixlnode
