// The NIXL engine: the Engine interface over a real nixlAgent (compiled only
// when the build found an installed NIXL; see scripts/find-nixl.js).
//
// Transfers are posted and polled by the engine's own thread (poller.h). The
// agent runs with syncMode RW so that thread and the JS thread may call it
// concurrently.
#include <dlfcn.h>
#include <nixl.h>
#include <nixl_node_status_table.h>

#include <atomic>
#include <chrono>
#include <unordered_map>
#include <vector>

#include "../engine.h"
#include "../lookup.h"
#include "poller.h"
#include "reg_index.h"

namespace nixlnode {
namespace {

using nixl::Poller;
using nixl::Request;
using nixl::RequestP;
using Clock = std::chrono::steady_clock;

void check(nixl_status_t s, const char* what) {
  if (s != NIXL_SUCCESS && s != NIXL_IN_PROG)
    throw EngineError(static_cast<int>(s), std::string(what) + ": " + nixlEnumStrings::statusStr(s));
}

nixl_mem_t memType(MemType t) { return static_cast<nixl_mem_t>(static_cast<int>(t)); }

nixl_xfer_dlist_t xferList(const std::vector<Desc>& descs, MemType t) {
  nixl_xfer_dlist_t dl(memType(t));
  for (const auto& d : descs) dl.addDesc(nixlBasicDesc(static_cast<uintptr_t>(d.addr), d.len, d.devId));
  return dl;
}

// Our status numbers are NIXL's (native/status.h); the build's table is read
// from the very header compiled here (scripts/gen-status-table.js).
constexpr bool sameCode(int ours, int nixl) { return ours == nixl; }
static_assert(sameCode(ERR_NOT_POSTED, NIXL_ERR_NOT_POSTED), "native/status.h: ERR_NOT_POSTED must be NIXL's number");
static_assert(sameCode(ERR_INVALID_PARAM, NIXL_ERR_INVALID_PARAM),
              "native/status.h: ERR_INVALID_PARAM must be NIXL's number");
static_assert(sameCode(ERR_BACKEND, NIXL_ERR_BACKEND), "native/status.h: ERR_BACKEND must be NIXL's number");
static_assert(sameCode(ERR_NOT_FOUND, NIXL_ERR_NOT_FOUND), "native/status.h: ERR_NOT_FOUND must be NIXL's number");
static_assert(sameCode(ERR_MISMATCH, NIXL_ERR_MISMATCH), "native/status.h: ERR_MISMATCH must be NIXL's number");
static_assert(sameCode(ERR_NOT_ALLOWED, NIXL_ERR_NOT_ALLOWED),
              "native/status.h: ERR_NOT_ALLOWED must be NIXL's number");
static_assert(sameCode(ERR_REPOST_ACTIVE, NIXL_ERR_REPOST_ACTIVE),
              "native/status.h: ERR_REPOST_ACTIVE must be NIXL's number");
static_assert(sameCode(ERR_UNKNOWN, NIXL_ERR_UNKNOWN), "native/status.h: ERR_UNKNOWN must be NIXL's number");
static_assert(sameCode(ERR_NOT_SUPPORTED, NIXL_ERR_NOT_SUPPORTED),
              "native/status.h: ERR_NOT_SUPPORTED must be NIXL's number");
static_assert(sameCode(ERR_REMOTE_DISCONNECT, NIXL_ERR_REMOTE_DISCONNECT),
              "native/status.h: ERR_REMOTE_DISCONNECT must be NIXL's number");
static_assert(sameCode(ERR_CANCELED, NIXL_ERR_CANCELED), "native/status.h: ERR_CANCELED must be NIXL's number");
static_assert(sameCode(ERR_NO_TELEMETRY, NIXL_ERR_NO_TELEMETRY),
              "native/status.h: ERR_NO_TELEMETRY must be NIXL's number");

// A prepared list, and what each of its descriptors resolved to.
struct Dlist {
  nixlDlistH* h = nullptr;
  std::vector<uint32_t> first;  // descriptor i covers regs[first[i]] .. regs[first[i + 1] - 1]
  std::vector<Handle> regs;
  std::vector<uint64_t> lens;   // each descriptor's length
  std::vector<uint64_t> addrs;  // each descriptor's address (this agent's own lists only: LocalPages)
  std::string agent;            // empty: this agent's own memory
  uint64_t agentGen = 0;

  // Bytes of the descriptors idx[0..n) (out of range counts nothing: NIXL refuses it).
  uint64_t bytes(const uint32_t* idx, size_t n) const {
    uint64_t b = 0;
    for (size_t k = 0; k < n; k++)
      if (idx[k] < lens.size()) b += lens[idx[k]];
    return b;
  }

  // Appends the registrations the descriptors idx[0..n) cover. An index out
  // of range adds nothing: NIXL refuses it itself.
  void regsUsed(const uint32_t* idx, size_t n, std::vector<Handle>& out) const {
    if (first.empty()) return;  // a remote agent's list
    for (size_t k = 0; k < n; k++)
      if (static_cast<size_t>(idx[k]) + 1 < first.size())
        out.insert(out.end(), regs.begin() + first[idx[k]], regs.begin() + first[idx[k] + 1]);
  }
};

class NixlEngine final : public Engine {
 public:
  NixlEngine(const std::string& name, const EngineConfig& cfg, CompletionSink* sink)
      : cfg_(cfg),
        sink_(sink),
        name_(name),
        agent_(name, nixlAgentConfig(cfg.progressThread, cfg.listenPort > 0,
                                     static_cast<uint16_t>(cfg.listenPort > 0 ? cfg.listenPort : default_comm_port),
                                     nixl_thread_sync_t::NIXL_THREAD_SYNC_RW, 1,
                                     cfg.progressThread ? std::max<uint64_t>(cfg.progressDelayUs, 1000) : 0,
                                     nixlAgentConfig::kDefaultLthrDelayUs, cfg.captureTelemetry)) {
    handles_.start(cfg.testFirstHandle);
    for (const auto& b : cfg.backends) createBackend(b, {});
  }

  ~NixlEngine() override { close(); }

  const char* kind() const override { return "nixl"; }

  std::vector<std::string> getPluginList() override {
    std::vector<nixl_backend_t> plugins;
    check(agent_.getAvailPlugins(plugins), "getAvailPlugins");
    return {plugins.begin(), plugins.end()};
  }

  PluginInfo getPluginParams(const std::string& plugin) override {
    nixl_mem_list_t mems;
    nixl_b_params_t params;
    check(agent_.getPluginParams(plugin, mems, params), "getPluginParams");
    PluginInfo info;
    for (auto& [k, v] : params) info.params[k] = v;
    for (auto m : mems) info.memTypes.push_back(static_cast<MemType>(static_cast<int>(m)));
    return info;
  }

  void createBackend(const std::string& plugin, const Params& params) override {
    checkOpen();
    if (backends_.count(plugin)) throw EngineError(ERR_NOT_ALLOWED, "backend " + plugin + " already created");
    nixl_b_params_t p(params.begin(), params.end());
    nixlBackendH* h = nullptr;
    check(agent_.createBackend(plugin, p, h), ("createBackend(" + plugin + ")").c_str());
    backends_[plugin] = h;
    poller_.backendCreated();
  }

  std::vector<std::string> getBackends() override {
    std::vector<std::string> out;
    for (auto& [n, h] : backends_) out.push_back(n);
    return out;
  }

  PluginInfo getBackendParams(const std::string& backend) override {
    checkOpen();
    nixlBackendH* bh = lookup(backends_, backend, "getBackendParams", "backend");
    nixl_mem_list_t mems;
    nixl_b_params_t params;
    check(agent_.getBackendParams(bh, mems, params), "getBackendParams");
    PluginInfo info;
    for (auto& [k, v] : params) info.params[k] = v;
    for (auto m : mems) info.memTypes.push_back(static_cast<MemType>(static_cast<int>(m)));
    return info;
  }

  Handle registerMem(const std::vector<Desc>& descs, MemType type, const std::vector<std::string>& backends) override {
    checkOpen();
    if (descs.empty()) throw EngineError(ERR_INVALID_PARAM, "registerMem: empty descriptor list");
    handles_.check("registerMem");
    nixl_reg_dlist_t dl = regList(descs, type);
    nixl_opt_args_t args = opts(backends);
    check(agent_.registerMem(dl, &args), "registerMem");
    Handle h = handles_.take("registerMem");
    regs_.emplace(h, std::make_pair(dl, backends));
    regIndex_.add(h, descs, type);
    return h;
  }

  void deregisterMem(Handle reg) override {
    checkOpen();
    auto& [dl, backends] = lookup(regs_, reg, "deregisterMem", "memory registration");
    // NIXL does not stop a transfer from using memory deregistered under it:
    // refuse while a queued, running or released-but-unfinished one uses it.
    size_t users =
        poller_.countActive([reg](const Request& r) { return std::binary_search(r.regs.begin(), r.regs.end(), reg); });
    if (users > 0)
      throw EngineError(ERR_NOT_ALLOWED, "deregisterMem: " + std::to_string(users) +
                                             " transfer(s) using this memory are queued or in flight; wait for "
                                             "them or release them first");
    nixl_opt_args_t args = opts(backends);
    check(agent_.deregisterMem(dl, &args), "deregisterMem");
    regs_.erase(reg);
    regIndex_.remove(reg);
    ++deregistered_;
  }

  std::string getLocalMD() override {
    checkOpen();
    nixl_blob_t md;
    check(agent_.getLocalMD(md), "getLocalMD");
    return md;
  }

  std::string getLocalPartialMD(const std::vector<Desc>& descs, MemType type, bool includeConnInfo,
                                const std::vector<std::string>& backends) override {
    checkOpen();
    nixl_opt_args_t args = opts(backends);
    args.includeConnInfo = includeConnInfo;
    nixl_blob_t md;
    check(agent_.getLocalPartialMD(regList(descs, type), md, &args), "getLocalPartialMD");
    return md;
  }

  void sendLocalMD(const std::string& ip, int port) override {
    checkOpen();
    nixl_opt_args_t args = peer(ip, port);
    check(agent_.sendLocalMD(&args), "sendLocalMD");
  }

  void sendLocalPartialMD(const std::vector<Desc>& descs, MemType type, bool includeConnInfo,
                          const std::vector<std::string>& backends, const std::string& ip, int port,
                          const std::string& label) override {
    checkOpen();
    nixl_opt_args_t args = opts(backends);
    toPeer(args, ip, port);
    args.includeConnInfo = includeConnInfo;
    args.metadataLabel = label;  // etcd: the key's last part (NIXL requires one there)
    check(agent_.sendLocalPartialMD(regList(descs, type), &args), "sendLocalPartialMD");
  }

  void fetchRemoteMD(const std::string& agent, const std::string& ip, int port, const std::string& label) override {
    checkOpen();
    nixl_opt_args_t args = peer(ip, port);
    args.metadataLabel = label;  // etcd: empty reads the full metadata
    check(agent_.fetchRemoteMD(agent, &args), "fetchRemoteMD");
  }

  void invalidateLocalMD(const std::string& ip, int port) override {
    checkOpen();
    nixl_opt_args_t args = peer(ip, port);
    check(agent_.invalidateLocalMD(&args), "invalidateLocalMD");
  }

  bool checkRemoteMD(const std::string& agent, const std::vector<Desc>& descs, MemType type) override {
    checkOpen();
    nixl_status_t s = agent_.checkRemoteMD(agent, xferList(descs, type));
    if (s == NIXL_SUCCESS) return true;
    if (s == NIXL_ERR_NOT_FOUND) return false;
    check(s, "checkRemoteMD");
    return false;
  }

  void makeConnection(const std::string& agent) override {
    checkOpen();
    check(agent_.makeConnection(agent), "makeConnection");
  }

  std::vector<std::optional<Params>> queryMem(const std::vector<Desc>& descs, MemType type,
                                              const std::vector<std::string>& backends) override {
    checkOpen();
    nixl_opt_args_t args = opts(backends);
    std::vector<nixl_query_resp_t> resp;
    check(agent_.queryMem(regList(descs, type), resp, &args), "queryMem");
    std::vector<std::optional<Params>> out;
    for (auto& r : resp) {
      if (r)
        out.push_back(Params(r->begin(), r->end()));
      else
        out.push_back(std::nullopt);
    }
    return out;
  }

  Cost estimateXferCost(Handle h) override {
    checkOpen();
    RequestP req = find(h, "estimateXferCost");
    std::chrono::microseconds d{}, m{};
    nixl_cost_t method{};
    check(agent_.estimateXferCost(req->h, d, m, method), "estimateXferCost");
    return Cost{static_cast<uint64_t>(d.count()), static_cast<uint64_t>(m.count()), static_cast<int>(method)};
  }

  std::string loadRemoteMD(const std::string& md) override {
    checkOpen();
    std::string name;
    check(agent_.loadRemoteMD(md, name), "loadRemoteMD");
    return name;
  }

  void invalidateRemoteMD(const std::string& agent) override {
    checkOpen();
    // NIXL frees the agent's connection and remote keys at once, under
    // whatever still uses them.
    uint64_t gen = agentGen_[agent];
    size_t users = poller_.countActive([&](const Request& r) { return r.agent == agent && r.agentGen == gen; });
    if (users > 0)
      throw EngineError(ERR_NOT_ALLOWED, "removeRemoteAgent: " + std::to_string(users) + " transfer(s) to " + agent +
                                             " are queued or in flight; wait for them or release them first");
    check(agent_.invalidateRemoteMD(agent), "invalidateRemoteMD");
    agentGen_[agent]++;   // lists and requests made before now refer to what was freed
    rates_.erase(agent);  // what its posts cost says nothing of the agent loaded next under that name
  }

  Handle prepXferDlist(const std::string& agent, const std::vector<Desc>& descs, MemType type,
                       const std::vector<std::string>& backends) override {
    checkOpen();
    handles_.check("prepXferDlist");
    nixlDlistH* dh = nullptr;
    nixl_opt_args_t args = opts(backends);
    const bool local = agent.empty() || agent == NIXL_INIT_AGENT;
    check(agent_.prepXferDlist(local ? NIXL_INIT_AGENT : agent, xferList(descs, type), dh, &args), "prepXferDlist");
    Dlist d;
    d.h = dh;
    d.lens.reserve(descs.size());
    for (const auto& desc : descs) d.lens.push_back(desc.len);
    if (!local) {
      d.agent = agent;
      d.agentGen = agentGen_[agent];
    }
    if (local && type == MemType::DRAM) {  // host memory: what mincore can look at
      d.addrs.reserve(descs.size());
      for (const auto& desc : descs) d.addrs.push_back(desc.addr);
    }
    if (local || agent == name_) {  // our own memory (a transfer to ourselves included)
      d.first.reserve(descs.size() + 1);
      for (const auto& desc : descs) {
        d.first.push_back(static_cast<uint32_t>(d.regs.size()));
        regIndex_.covering(desc, type, d.regs);
      }
      d.first.push_back(static_cast<uint32_t>(d.regs.size()));
    }
    Handle h = handles_.take("prepXferDlist");
    dlists_.emplace(h, std::move(d));
    return h;
  }

  void releaseDlist(Handle h) override {
    checkOpen();
    check(agent_.releasedDlistH(lookup(dlists_, h, "releaseDlistHandle", "descriptor list handle").h),
          "releasedDlistH");
    dlists_.erase(h);
  }

  Handle makeXferReq(XferOp op, Handle local, const uint32_t* li, size_t nl, Handle remote, const uint32_t* ri,
                     size_t nr, const std::string* notif) override {
    checkOpen();
    handles_.check("makeXferReq");
    const Dlist& L = lookup(dlists_, local, "makeXferReq", "local descriptor list handle");
    const Dlist& R = lookup(dlists_, remote, "makeXferReq", "remote descriptor list handle");
    std::vector<int> lv(li, li + nl), rv(ri, ri + nr);
    for (const Dlist* d : {&L, &R})
      if (!d->agent.empty() && !agentCurrent(d->agent, d->agentGen))
        throw EngineError(ERR_NOT_FOUND,
                          "makeXferReq: " + d->agent + " was removed since the list was prepared; prepare it again");
    std::vector<Handle> regs;
    L.regsUsed(li, nl, regs);
    R.regsUsed(ri, nr, regs);
    regs = RegIndex::unique(std::move(regs));
    if (!allRegistered(regs))
      throw EngineError(ERR_NOT_FOUND, "makeXferReq: memory of the list was deregistered since it was prepared");
    nixl_opt_args_t args;
    setNotif(args, notif);
    nixlXferReqH* xh = nullptr;
    check(agent_.makeXferReq(op == XferOp::READ ? NIXL_READ : NIXL_WRITE, L.h, lv, R.h, rv, xh, &args), "makeXferReq");
    LocalPages pages;
    for (size_t k = 0; k < nl; k++)
      if (li[k] < L.addrs.size()) pages.add(L.addrs[li[k]], L.lens[li[k]]);
    return addRequest(xh, std::move(regs), R.agent, R.agentGen, L.bytes(li, nl), nl, op, std::move(pages));
  }

  Handle createXferReq(XferOp op, const std::vector<Desc>& local, MemType lt, const std::vector<Desc>& remote,
                       MemType rt, const std::string& agent, const std::string* notif) override {
    checkOpen();
    handles_.check("createXferReq");
    nixl_opt_args_t args;
    setNotif(args, notif);
    nixlXferReqH* xh = nullptr;
    check(agent_.createXferReq(op == XferOp::READ ? NIXL_READ : NIXL_WRITE, xferList(local, lt), xferList(remote, rt),
                               agent, xh, &args),
          "createXferReq");
    std::vector<Handle> regs = regIndex_.covering(local, lt);
    if (agent == name_) {
      std::vector<Handle> more = regIndex_.covering(remote, rt);
      regs.insert(regs.end(), more.begin(), more.end());
    }
    uint64_t bytes = 0;
    for (const auto& d : local) bytes += d.len;
    LocalPages pages;
    if (lt == MemType::DRAM)
      for (const auto& d : local) pages.add(d.addr, d.len);
    return addRequest(xh, RegIndex::unique(std::move(regs)), agent, agentGen_[agent], bytes, local.size(), op,
                      std::move(pages));
  }

  int postXferReq(Handle h, const std::string* notif, bool mayInline, bool /*checkPeer*/,
                  bool /*moreFollow*/) override {
    checkOpen();
    // By reference: only this thread erases from requests_.
    const RequestP& req = find(h, "postXferReq");
    if (req->status.load() == IN_PROG)
      throw EngineError(ERR_REPOST_ACTIVE, "postXferReq: transfer is still in progress");
    // Registrations go only by deregisterMem: with none gone since this
    // request's were last all found, none is missing.
    if (req->regsFoundAt != deregistered_) {
      if (!allRegistered(req->regs))
        throw EngineError(ERR_NOT_FOUND, "postXferReq: memory of this transfer was deregistered since it was made");
      req->regsFoundAt = deregistered_;
    }
    if (*req->agentGenNow != req->agentGen)
      throw EngineError(ERR_NOT_FOUND, "postXferReq: " + req->agent + " was removed since this transfer was made");
    // Small, or a post of it (or, never timed, the agent's last timed post)
    // says it takes little time: on this thread. A larger one is timed
    // wherever it runs, so the next post of it (or to its agent) can choose.
    bool inl =
        mayInline && inlineAllowed(cfg_, req->totalBytes,
                                   expectedPostUs(cfg_, req->op, req->totalBytes, req->descs,
                                                  req->postUs.load(std::memory_order_relaxed), *req->rate, req->pages));
    return poller_.post(req, notif, inl, req->totalBytes > cfg_.inlineMaxBytes);
  }

  uint64_t xferBytes(Handle h) override {
    checkOpen();
    return find(h, "xferBytes")->totalBytes;
  }

  int getXferStatus(Handle h, std::string* errMsg) override {
    checkOpen();
    RequestP req = find(h, "checkXferState");
    int s = req->status.load(std::memory_order_acquire);
    if (s == IN_PROG && cfg_.inlineMaxBytes > 0) s = poller_.checkNow(*req);
    if (s < 0 && errMsg) *errMsg = req->err;
    return s;
  }

  void releaseXferReq(Handle h) override {
    checkOpen();
    RequestP req = find(h, "releaseXferHandle");
    bool wasInflight = req->status.load() == IN_PROG;
    poller_.release(req);
    requests_.erase(h);
    if (wasInflight) sink_->onComplete(h);  // every IN_PROG post completes exactly once
  }

  Telemetry getXferTelemetry(Handle h) override {
    checkOpen();
    RequestP req = find(h, "getXferTelemetry");
    nixl_xfer_telem_t t{};
    check(agent_.getXferTelemetry(req->h, t), "getXferTelemetry");
    auto sinceStart = std::chrono::duration_cast<std::chrono::microseconds>(Clock::now() - t.startTime).count();
    auto nowUs =
        std::chrono::duration_cast<std::chrono::microseconds>(std::chrono::system_clock::now().time_since_epoch())
            .count();
    return Telemetry{static_cast<uint64_t>(nowUs - sinceStart), static_cast<uint64_t>(t.postDuration.count()),
                     static_cast<uint64_t>(t.xferDuration.count()), t.totalBytes, t.descCount};
  }

  std::string queryXferBackend(Handle h) override {
    checkOpen();
    RequestP req = find(h, "queryXferBackend");
    nixlBackendH* b = nullptr;
    check(agent_.queryXferBackend(req->h, b), "queryXferBackend");
    // NIXL answers with a handle; its name is the one createBackend gave it.
    for (auto& [n, bh] : backends_)
      if (bh == b) return n;
    throw EngineError(ERR_NOT_FOUND, "queryXferBackend: NIXL chose a backend this agent did not create");
  }

  void genNotif(const std::string& agent, const std::string& msg) override {
    checkOpen();
    check(agent_.genNotif(agent, msg), "genNotif");
  }

  void getNotifs(std::vector<std::pair<std::string, std::string>>& out) override {
    checkOpen();
    poller_.takeNotifs(out);
  }

  void watchNotifs(bool on) override { poller_.watchNotifs(on); }

  void close() override {
    if (closed_.exchange(true)) return;
    poller_.stop();
    for (auto& [h, req] : requests_) agent_.releaseXferReq(req->h);
    requests_.clear();
    for (auto& [h, d] : dlists_) agent_.releasedDlistH(d.h);
    dlists_.clear();
    for (auto& [h, r] : regs_) {
      nixl_opt_args_t args = opts(r.second);
      agent_.deregisterMem(r.first, &args);
    }
    regs_.clear();
  }

 private:
  void checkOpen() const {
    if (closed_) throw EngineError(ERR_NOT_ALLOWED, "agent is closed");
  }

  nixl_opt_args_t opts(const std::vector<std::string>& backends) const {
    nixl_opt_args_t a;
    for (const auto& b : backends) {
      auto it = backends_.find(b);
      if (it == backends_.end()) throw EngineError(ERR_NOT_FOUND, "backend '" + b + "' was not created");
      a.backends.push_back(it->second);
    }
    return a;
  }

  static nixl_reg_dlist_t regList(const std::vector<Desc>& descs, MemType type) {
    nixl_reg_dlist_t dl(memType(type));
    for (const auto& d : descs) dl.addDesc(nixlBlobDesc(static_cast<uintptr_t>(d.addr), d.len, d.devId, ""));
    return dl;
  }

  // ip empty: NIXL's etcd mode (NIXL_ETCD_ENDPOINTS), else the peer's listener.
  static nixl_opt_args_t peer(const std::string& ip, int port) {
    nixl_opt_args_t a;
    toPeer(a, ip, port);
    return a;
  }

  static void toPeer(nixl_opt_args_t& a, const std::string& ip, int port) {
    if (!ip.empty()) {
      a.ipAddr = ip;
      a.port = port > 0 ? port : default_comm_port;
    }
  }

  static void setNotif(nixl_opt_args_t& a, const std::string* notif) {
    if (notif) {
      a.notifMsg = *notif;
      a.hasNotif = true;
    }
  }

  Handle addRequest(nixlXferReqH* xh, std::vector<Handle> regs, const std::string& agent, uint64_t agentGen,
                    uint64_t totalBytes, uint64_t descs, XferOp op, LocalPages pages) {
    auto req = std::make_shared<Request>();
    req->id = handles_.take("transfer request");
    req->h = xh;
    req->regs = std::move(regs);
    req->agent = agent;
    req->agentGen = agentGen;
    req->agentGenNow = &agentGen_[agent];  // unordered_map entries stay put
    req->totalBytes = totalBytes;
    req->descs = descs;
    req->op = op;
    req->pages = std::move(pages);
    auto& rate = rates_[agent];
    if (!rate) rate = std::make_shared<PostRate>();
    req->rate = rate;
    requests_[req->id] = req;
    return req->id;
  }

  // Not removed (removeRemoteAgent) since gen was taken.
  bool agentCurrent(const std::string& agent, uint64_t gen) const {
    auto it = agentGen_.find(agent);
    return (it == agentGen_.end() ? 0 : it->second) == gen;
  }

  bool allRegistered(const std::vector<Handle>& regs) const {
    for (Handle r : regs)
      if (!regs_.count(r)) return false;
    return true;
  }

  RequestP& find(Handle h, const char* call) { return lookup(requests_, h, call, "transfer handle"); }

  const EngineConfig cfg_;
  CompletionSink* sink_;
  const std::string name_;
  nixlAgent agent_;
  std::atomic<bool> closed_{false};
  HandleCounter handles_;
  std::map<std::string, nixlBackendH*> backends_;
  std::unordered_map<Handle, std::pair<nixl_reg_dlist_t, std::vector<std::string>>> regs_;
  std::unordered_map<Handle, Dlist> dlists_;
  RegIndex regIndex_;
  std::unordered_map<std::string, uint64_t> agentGen_;  // bumped by invalidateRemoteMD; never erased
  // Per remote agent, this load of it: requests keep theirs, so one made
  // before a removal never feeds the next load's (it cannot be posted anyway).
  std::unordered_map<std::string, std::shared_ptr<PostRate>> rates_;
  uint64_t deregistered_ = 0;  // deregisterMem calls that succeeded
  std::unordered_map<Handle, RequestP> requests_;

  Poller poller_{agent_, sink_};  // after every member its thread uses
};

}  // namespace

// NIXL loads plugins from NIXL_PLUGIN_DIR; when unset, point it at the
// plugins/ directory beside the libnixl.so this addon is linked against.
void defaultPluginDir() {
  if (getenv("NIXL_PLUGIN_DIR")) return;
  Dl_info info{};
  if (!dladdr(reinterpret_cast<void*>(&nixlEnumStrings::statusStr), &info) || !info.dli_fname) return;
  std::string lib(info.dli_fname);
  auto slash = lib.rfind('/');
  if (slash == std::string::npos) return;
  std::string dir = lib.substr(0, slash) + "/plugins";
  setenv("NIXL_PLUGIN_DIR", dir.c_str(), 0);
}

std::unique_ptr<Engine> makeNixlEngine(const std::string& name, const EngineConfig& cfg, CompletionSink* sink) {
  defaultPluginDir();
  try {
    return std::make_unique<NixlEngine>(name, cfg, sink);
  } catch (const EngineError&) {
    throw;
  } catch (const std::exception& e) {
    throw EngineError(ERR_BACKEND, std::string("creating the NIXL agent failed: ") + e.what());
  }
}

}  // namespace nixlnode
