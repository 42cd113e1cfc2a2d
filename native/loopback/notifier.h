// Sends an agent's notifications without ever blocking a copy: a peer whose
// queue is full (stalled, stopped, slow) gets its own FIFO, retried with
// back-off on this thread, while notifications to every other peer go out at
// once. Order per peer is kept: nothing overtakes a queued notification.
#pragma once
#include <chrono>
#include <condition_variable>
#include <deque>
#include <functional>
#include <mutex>
#include <string>
#include <thread>
#include <unordered_map>

#include "notif_socket.h"

namespace nixlnode::loopback {

class Notifier {
 public:
  // 0 when delivered, else an errno (ETIMEDOUT: the peer stayed full). Runs on
  // the notifier thread, without its lock held.
  using Done = std::function<void(int err)>;
  static constexpr std::chrono::milliseconds kGiveUpAfter{5000};

  Notifier(const NotifSocket& sock, std::string from);
  ~Notifier();
  Notifier(const Notifier&) = delete;
  Notifier& operator=(const Notifier&) = delete;

  // 0: delivered now (done is not called); EINPROGRESS: queued, done is called
  // later; any other errno: failed now (done is not called). Thread-safe.
  int send(const std::string& to, const std::string& msg, Done done);
  // Stops the thread; queued notifications are dropped without a callback.
  void stop();

 private:
  using Clock = std::chrono::steady_clock;
  struct Item {
    std::string msg;
    Done done;
    Clock::time_point deadline;
  };
  struct Peer {
    std::deque<Item> queue;
    Clock::time_point retryAt{};
    std::chrono::microseconds backoff{200};
  };
  void loop();

  const NotifSocket& sock_;
  const std::string from_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::unordered_map<std::string, Peer> peers_;  // only peers with a queue
  bool stopping_ = false;
  std::thread thread_;
};

}  // namespace nixlnode::loopback
