// The NIXL engine's own thread: it posts what the JS thread queues, asks NIXL
// about every request in flight and drains notifications.
//
// UCX's cma transport finishes a one-host READ inside postXferReq, so posting
// on the JS thread would block the event loop for the whole copy: transfer()
// queues the request here and returns IN_PROG in microseconds (small ones may
// be posted inline, see post()). NIXL has no completion callbacks: this thread
// asks getXferStatus for every request in flight and drains getNotifs (which
// also progresses the target side of READs when NIXL's own progress thread is
// off), backing off when nothing happens (see loop()).
#pragma once
#include <nixl.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "../engine.h"

namespace nixlnode::nixl {

struct Request {
  Handle id;
  nixlXferReqH* h = nullptr;
  std::atomic<int> status{ERR_NOT_POSTED};
  std::string err;        // written by the poller before status (release), read after (acquire)
  bool hasNotif = false;  // the message of the next post (guarded by the poller's lock)
  std::string notif;
  bool released = false;  // released by JS while the poller was posting it (guarded by the poller's lock)
  bool timeIt = false;    // the queued post is timed into postUs (guarded by the poller's lock)
  // What the NIXL request resolved when it was made (see reg_index.h): the
  // local registrations it covers, and the remote agent's load generation.
  std::vector<Handle> regs;
  std::string agent;
  uint64_t agentGen = 0;
  uint64_t totalBytes = 0;  // of the local side: whether it may be posted inline
  uint64_t descs = 0;       // of the local side, for the remote agent's PostRate
  XferOp op = XferOp::READ;
  LocalPages pages;  // the local side's memory, checked before a first post is predicted (expectedPostUs)
  // How long its last timed post took (posts over EngineConfig::inlineMaxBytes are timed).
  std::atomic<uint32_t> postUs{kPostUsUnknown};
  // The remote agent's (this load of it), fed by every accepted timed post.
  std::shared_ptr<PostRate> rate;
  // The JS thread's, for postXferReq's checks without a lookup by name: the
  // agent's current generation (an entry of the engine's map, never erased),
  // and the engine's count of deregistrations when regs were last all found.
  const uint64_t* agentGenNow = nullptr;
  uint64_t regsFoundAt = UINT64_MAX;
};
using RequestP = std::shared_ptr<Request>;

// "transfer failed: ..." (or what a stalled transfer means) for a status NIXL answered.
std::string failureText(nixl_status_t s);

class Poller {
 public:
  Poller(nixlAgent& agent, CompletionSink* sink);
  ~Poller();
  Poller(const Poller&) = delete;
  Poller& operator=(const Poller&) = delete;

  // NIXL logs an error for each getNotifs while the agent has no backend, and
  // this thread starts before the first one is created.
  void backendCreated() { hasBackend_.store(true, std::memory_order_release); }

  // Posts req: on the calling thread when inlineOk and nothing is queued ahead
  // of it (nothing overtakes a transfer or notification posted before it),
  // else through this thread. SUCCESS, IN_PROG or a NIXL error, as postXferReq.
  // timeIt: record the post's duration in req->postUs, and in req->rate if
  // NIXL accepted it (on either thread).
  int post(const RequestP& req, const std::string* notif, bool inlineOk, bool timeIt);
  // NIXL's check_xfer_state on the calling thread: asks NIXL about a request
  // in flight now instead of waiting for this thread's next look.
  int checkNow(Request& req);
  // Releases the NIXL request, or hands it to this thread while NIXL is
  // posting it or cannot abort it yet.
  void release(const RequestP& req);
  // Requests NIXL may still be using: queued, being posted, in flight, or
  // released while unfinished.
  size_t countActive(const std::function<bool(const Request&)>& uses);

  void takeNotifs(std::vector<std::pair<std::string, std::string>>& out);
  void watchNotifs(bool on);
  // Joins the thread and releases what it still held.
  void stop();

 private:
  bool drainNotifs();
  void postQueued(std::unique_lock<std::mutex>& lk, std::vector<RequestP>& done);
  void loop();

  std::chrono::microseconds firstIdleWait() const;
  std::chrono::microseconds maxIdleWait() const;

  nixlAgent& agent_;
  CompletionSink* sink_;

  std::mutex mu_;  // toPost_, posting_, inflight_, zombies_, wake_, stopping_, Request::hasNotif/notif/released
  std::condition_variable cv_;
  std::vector<RequestP> toPost_;
  RequestP posting_;
  // toPost_'s size plus 1 while posting_ is set, written under mu_: post()
  // reads it without mu_ to post inline.
  std::atomic<uint32_t> busy_{0};
  std::vector<RequestP> inflight_;
  std::vector<RequestP> zombies_;
  bool wake_ = false;
  bool stopping_ = false;
  std::atomic<bool> notifWatched_{false};
  std::atomic<bool> hasBackend_{false};
  std::thread thread_;

  std::mutex nMu_;
  std::vector<std::pair<std::string, std::string>> notifs_;
};

}  // namespace nixlnode::nixl
