#include "notifier.h"

#include <cerrno>
#include <utility>
#include <vector>

namespace nixlnode::loopback {

Notifier::Notifier(const NotifSocket& sock, std::string from) : sock_(sock), from_(std::move(from)) {
  thread_ = std::thread([this] { loop(); });
}

Notifier::~Notifier() { stop(); }

void Notifier::stop() {
  {
    std::lock_guard<std::mutex> lk(mu_);
    if (stopping_ && !thread_.joinable()) return;
    stopping_ = true;
  }
  cv_.notify_all();
  if (thread_.joinable()) thread_.join();
  peers_.clear();
}

int Notifier::send(const std::string& to, const std::string& msg, Done done) {
  std::lock_guard<std::mutex> lk(mu_);
  if (stopping_) return ECANCELED;
  auto it = peers_.find(to);
  if (it == peers_.end()) {
    int e = sock_.send(to, from_, msg);
    if (e != EAGAIN && e != EWOULDBLOCK) return e;
    it = peers_.emplace(to, Peer{}).first;
    it->second.retryAt = Clock::now() + it->second.backoff;
  }
  it->second.queue.push_back(Item{msg, std::move(done), Clock::now() + kGiveUpAfter});
  cv_.notify_one();
  return EINPROGRESS;
}

void Notifier::loop() {
  std::unique_lock<std::mutex> lk(mu_);
  std::vector<std::pair<Done, int>> finished;
  while (!stopping_) {
    auto now = Clock::now();
    auto wake = now + std::chrono::seconds(1);
    for (auto it = peers_.begin(); it != peers_.end();) {
      Peer& p = it->second;
      if (p.retryAt <= now) {
        while (!p.queue.empty()) {
          Item& item = p.queue.front();
          int e = sock_.send(it->first, from_, item.msg);
          if (e == EAGAIN || e == EWOULDBLOCK) {
            if (item.deadline > now) break;
            e = ETIMEDOUT;
          }
          finished.emplace_back(std::move(item.done), e);
          p.queue.pop_front();
          p.backoff = std::chrono::microseconds(200);
        }
        if (!p.queue.empty()) {
          p.retryAt = now + p.backoff;
          p.backoff = std::min(p.backoff * 2, std::chrono::microseconds(50'000));
        }
      }
      if (p.queue.empty()) {
        it = peers_.erase(it);
        continue;
      }
      wake = std::min(wake, p.retryAt);
      ++it;
    }
    if (!finished.empty()) {
      lk.unlock();
      for (auto& [done, e] : finished)
        if (done) done(e);
      finished.clear();
      lk.lock();
      continue;
    }
    if (peers_.empty())
      cv_.wait(lk, [this] { return stopping_ || !peers_.empty(); });
    else
      cv_.wait_until(lk, wake);
  }
}

}  // namespace nixlnode::loopback
