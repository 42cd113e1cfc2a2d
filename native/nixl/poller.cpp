#include "poller.h"

#include <nixl_node_status_table.h>

#include <algorithm>

namespace nixlnode::nixl {

std::string failureText(nixl_status_t s) {
#ifdef NIXL_NODE_HAS_NIXL_ERR_XFER_STALLED
  // NIXL gave up waiting (nixlAgentConfig xferStallTimeout) but did not abort:
  // the transfer may still complete, so its memory stays in use until it is released.
  if (s == NIXL_ERR_XFER_STALLED)
    return "transfer stalled past NIXL's xferStallTimeout (not aborted: it may still complete; release the handle "
           "before reusing its memory)";
#endif
  return std::string("transfer failed: ") + nixlEnumStrings::statusStr(s);
}

namespace {

// A timed post's duration, in the request and, accepted, in its agent's rate.
void recordTime(Request& req, std::chrono::steady_clock::time_point t0, nixl_status_t s) {
  uint32_t us = postUsSince(t0);
  req.postUs.store(us, std::memory_order_relaxed);
  if ((s == NIXL_SUCCESS || s == NIXL_IN_PROG) && req.rate) req.rate->record(req.totalBytes, req.descs, us);
}

// What a post NIXL answered leaves in req: its error text and final status.
void settle(Request& req, nixl_status_t s) {
  if (s != NIXL_SUCCESS) req.err = std::string("postXferReq: ") + nixlEnumStrings::statusStr(s);
  req.status.store(s == NIXL_SUCCESS ? SUCCESS : static_cast<int>(s), std::memory_order_release);
}

}  // namespace

Poller::Poller(nixlAgent& agent, CompletionSink* sink) : agent_(agent), sink_(sink) {
  thread_ = std::thread([this] { loop(); });
}

Poller::~Poller() { stop(); }

int Poller::post(const RequestP& req, const std::string* notif, bool inlineOk, bool timeIt) {
  // Small, and nothing queued ahead of it: post it here, as NIXL's Python
  // API does. UCX's cma finishes a one-host transfer inside postXferReq, so
  // most return done, with no hop to this thread and none back. Whether
  // anything is queued is read without mu_: only this thread queues, and
  // busy_ drops to 0 only once this thread's last postXferReq returned.
  if (inlineOk && busy_.load(std::memory_order_acquire) == 0) {
    req->err.clear();
  } else {
    std::lock_guard<std::mutex> lk(mu_);
    req->err.clear();
    if (!(inlineOk && toPost_.empty() && !posting_)) {
      if (notif) {
        req->hasNotif = true;
        req->notif = *notif;
      }
      req->status.store(IN_PROG, std::memory_order_release);
      req->timeIt = timeIt;
      toPost_.push_back(req);
      busy_.fetch_add(1, std::memory_order_relaxed);
      wake_ = true;
      cv_.notify_one();
      return IN_PROG;
    }
  }
  // Only the JS thread queues, releases or deregisters, so nothing changes the
  // request or what it uses while NIXL posts it.
  auto t0 = timeIt ? std::chrono::steady_clock::now() : std::chrono::steady_clock::time_point{};
  nixl_status_t s;
  if (notif) {
    nixl_opt_args_t args;
    args.notifMsg = *notif;
    args.hasNotif = true;
    s = agent_.postXferReq(req->h, &args);
  } else {
    s = agent_.postXferReq(req->h, nullptr);  // as the native program posts: no arguments built
  }
  if (timeIt) recordTime(*req, t0, s);
  if (s == NIXL_IN_PROG) {
    {
      std::lock_guard<std::mutex> lk(mu_);
      req->status.store(IN_PROG, std::memory_order_release);
      inflight_.push_back(req);
      wake_ = true;
    }
    cv_.notify_one();
    return IN_PROG;
  }
  settle(*req, s);
  return req->status.load(std::memory_order_relaxed);
}

// Whoever takes the request out of inflight_ (this or the poller) completes it, once.
int Poller::checkNow(Request& req) {
  std::lock_guard<std::mutex> lk(mu_);
  for (auto it = inflight_.begin(); it != inflight_.end(); ++it) {
    if (it->get() != &req) continue;
    nixl_status_t s = agent_.getXferStatus(req.h);
    if (s == NIXL_IN_PROG) return IN_PROG;
    if (s != NIXL_SUCCESS) req.err = failureText(s);
    req.status.store(static_cast<int>(s), std::memory_order_release);
    inflight_.erase(it);
    sink_->onCompleteHere(req.id);
    return static_cast<int>(s);
  }
  return req.status.load(std::memory_order_acquire);
}

void Poller::release(const RequestP& req) {
  std::lock_guard<std::mutex> lk(mu_);
  if (posting_ == req) {
    // This thread is inside postXferReq with it: it releases the NIXL request
    // itself once that call returns.
    req->released = true;
    return;
  }
  auto drop = [&](std::vector<RequestP>& v) {
    auto it = std::find(v.begin(), v.end(), req);
    if (it != v.end()) v.erase(it);
  };
  if (std::find(toPost_.begin(), toPost_.end(), req) != toPost_.end()) busy_.fetch_sub(1, std::memory_order_release);
  drop(toPost_);  // queued, never posted: nothing to abort
  drop(inflight_);
  // NIXL aborts an active request on release; one it cannot abort stays with
  // this thread, which releases it once it finishes.
  if (agent_.releaseXferReq(req->h) != NIXL_SUCCESS) zombies_.push_back(req);
}

size_t Poller::countActive(const std::function<bool(const Request&)>& uses) {
  std::lock_guard<std::mutex> lk(mu_);
  size_t n = 0;
  for (const auto* v : {&toPost_, &inflight_, &zombies_})
    for (const auto& r : *v) n += uses(*r) ? 1 : 0;
  if (posting_ && uses(*posting_)) n++;
  return n;
}

void Poller::takeNotifs(std::vector<std::pair<std::string, std::string>>& out) {
  drainNotifs();
  std::lock_guard<std::mutex> lk(nMu_);
  for (auto& n : notifs_) out.push_back(std::move(n));
  notifs_.clear();
}

void Poller::watchNotifs(bool on) {
  if (notifWatched_.exchange(on) == on || !on) return;
  std::lock_guard<std::mutex> lk(mu_);
  wake_ = true;  // start looking at the watched pace now, not after a 16 ms wait
  cv_.notify_one();
}

void Poller::stop() {
  {
    std::lock_guard<std::mutex> lk(mu_);
    if (stopping_ && !thread_.joinable()) return;
    stopping_ = true;
  }
  cv_.notify_all();
  if (thread_.joinable()) thread_.join();
  for (auto& z : zombies_) agent_.releaseXferReq(z->h);
  zombies_.clear();
}

bool Poller::drainNotifs() {
  if (!hasBackend_.load(std::memory_order_acquire)) return false;
  nixl_notifs_t got;
  if (agent_.getNotifs(got) != NIXL_SUCCESS || got.empty()) return false;
  bool any = false;
  {
    std::lock_guard<std::mutex> lk(nMu_);
    for (auto& [from, msgs] : got)
      for (auto& m : msgs) {
        notifs_.emplace_back(from, std::move(m));
        any = true;
      }
  }
  if (any) sink_->onNotif();
  return any;
}

// Posts what post() queued. postXferReq may run a whole one-host copy, so it
// is called without mu_ held; posting_ tells release() that the NIXL request
// is in use.
void Poller::postQueued(std::unique_lock<std::mutex>& lk, std::vector<RequestP>& done) {
  while (!toPost_.empty() && !stopping_) {
    RequestP req = toPost_.front();
    toPost_.erase(toPost_.begin());
    nixl_opt_args_t args;
    bool withNotif = req->hasNotif;
    if (withNotif) {
      args.notifMsg = req->notif;
      args.hasNotif = true;
      req->hasNotif = false;
    }
    posting_ = req;
    bool timeIt = req->timeIt;
    lk.unlock();
    auto t0 = timeIt ? std::chrono::steady_clock::now() : std::chrono::steady_clock::time_point{};
    nixl_status_t s = agent_.postXferReq(req->h, withNotif ? &args : nullptr);
    if (timeIt) recordTime(*req, t0, s);
    lk.lock();
    posting_.reset();
    busy_.fetch_sub(1, std::memory_order_release);
    if (req->released) {
      // Released by JS meanwhile (its completion was reported then).
      if (agent_.releaseXferReq(req->h) != NIXL_SUCCESS) zombies_.push_back(req);
      continue;
    }
    if (s == NIXL_IN_PROG) {
      inflight_.push_back(req);
      continue;
    }
    settle(*req, s);
    done.push_back(req);
  }
}

// Adaptive polling. In flight: poll back to back (getXferStatus is what
// progresses UCX when NIXL's progress thread is off) while requests keep
// finishing; after kSpinBudget of polls with no completion, sleep between
// polls, doubling from 2 us to kMaxBusySleep, so agents sharing cores do not
// each burn one. Idle: wait on the condition variable (a post wakes it at
// once), looking for notifications every 1 ms, backing off to kMaxIdleWait
// while none come. While JS waits for a notification (watchNotifs), look
// from every kWatchedWait up to kMaxWatchedWait instead: NIXL has no event
// for an arriving notification, and at 16 ms each push-mode request spent
// two such waits (PUSH_REG, then the WRITE's notification).
namespace {
constexpr int kSpinBudget = 64;
constexpr std::chrono::microseconds kMaxBusySleep{256};
constexpr std::chrono::microseconds kIdleWait{1000};
constexpr std::chrono::microseconds kMaxIdleWait{16000};
constexpr std::chrono::microseconds kWatchedWait{50};
constexpr std::chrono::microseconds kMaxWatchedWait{1000};
}  // namespace

std::chrono::microseconds Poller::firstIdleWait() const { return notifWatched_.load() ? kWatchedWait : kIdleWait; }
std::chrono::microseconds Poller::maxIdleWait() const { return notifWatched_.load() ? kMaxWatchedWait : kMaxIdleWait; }

void Poller::loop() {
  std::vector<RequestP> done;
  int fruitless = 0;
  std::chrono::microseconds busySleep{2};
  std::chrono::microseconds idleWait = firstIdleWait();
  for (;;) {
    bool progressed = false;
    {
      std::unique_lock<std::mutex> lk(mu_);
      if (inflight_.empty() && zombies_.empty() && toPost_.empty() && !wake_) {
        cv_.wait_for(lk, idleWait, [this] { return stopping_ || wake_; });
        if (!wake_) idleWait = std::min(idleWait * 2, maxIdleWait());
      }
      if (stopping_) return;
      if (wake_) {
        wake_ = false;
        idleWait = firstIdleWait();
        fruitless = 0;
        busySleep = std::chrono::microseconds(2);
      }
      postQueued(lk, done);
      if (stopping_) return;
      for (auto it = inflight_.begin(); it != inflight_.end();) {
        nixl_status_t s = agent_.getXferStatus((*it)->h);
        if (s == NIXL_IN_PROG) {
          ++it;
          continue;
        }
        if (s != NIXL_SUCCESS) (*it)->err = failureText(s);
        (*it)->status.store(static_cast<int>(s), std::memory_order_release);
        done.push_back(*it);
        it = inflight_.erase(it);
      }
      for (auto it = zombies_.begin(); it != zombies_.end();) {
        if (agent_.getXferStatus((*it)->h) != NIXL_IN_PROG && agent_.releaseXferReq((*it)->h) == NIXL_SUCCESS)
          it = zombies_.erase(it);
        else
          ++it;
      }
    }
    progressed = !done.empty();
    for (auto& r : done) sink_->onComplete(r->id);
    done.clear();
    if (drainNotifs()) {
      progressed = true;
      idleWait = firstIdleWait();
    }
    bool busy;
    {
      std::lock_guard<std::mutex> lk(mu_);
      busy = !inflight_.empty() || !zombies_.empty();
    }
    if (!busy) continue;
    if (progressed) {
      fruitless = 0;
      busySleep = std::chrono::microseconds(2);
    }
    if (++fruitless <= kSpinBudget) {
      std::this_thread::yield();
    } else {
      std::unique_lock<std::mutex> lk(mu_);
      cv_.wait_for(lk, busySleep, [this] { return stopping_ || wake_; });
      busySleep = std::min(busySleep * 2, kMaxBusySleep);
    }
  }
}

}  // namespace nixlnode::nixl
