// Notifications between loopback agents travel as datagrams on an
// abstract-namespace unix socket (one per agent, named in its metadata), so
// they reach agents in other processes on the host without a file on disk.
#pragma once
#include <cstddef>
#include <string>

namespace nixlnode {

class NotifSocket {
 public:
  static constexpr size_t kMaxMsg = 64 * 1024;

  NotifSocket();  // binds a fresh address; throws EngineError
  ~NotifSocket();
  NotifSocket(const NotifSocket&) = delete;
  NotifSocket& operator=(const NotifSocket&) = delete;

  const std::string& address() const { return addr_; }
  int fd() const { return fd_; }

  // Never blocks. Returns 0 or an errno (EAGAIN: the peer's queue is full;
  // loopback::Notifier queues and retries).
  int send(const std::string& to, const std::string& from, const std::string& msg) const;
  // Non-blocking; false when nothing is queued. Malformed datagrams are dropped.
  bool recv(std::string* from, std::string* msg);

 private:
  int fd_ = -1;
  std::string addr_;
  std::string buf_;
};

}  // namespace nixlnode
