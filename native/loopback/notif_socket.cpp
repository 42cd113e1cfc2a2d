#include "notif_socket.h"

#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstring>
#include <random>

#include "../status.h"

namespace nixlnode {
namespace {

socklen_t fillAddr(const std::string& name, sockaddr_un* sa) {
  memset(sa, 0, sizeof(*sa));
  sa->sun_family = AF_UNIX;
  // Abstract namespace: leading NUL, no file system entry to clean up.
  size_t n = std::min(name.size(), sizeof(sa->sun_path) - 1);
  memcpy(sa->sun_path + 1, name.data(), n);
  return static_cast<socklen_t>(offsetof(sockaddr_un, sun_path) + 1 + n);
}

}  // namespace

NotifSocket::NotifSocket() {
  fd_ = socket(AF_UNIX, SOCK_DGRAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
  if (fd_ < 0) throw EngineError(ERR_BACKEND, std::string("notif socket: ") + strerror(errno));
  int sz = 4 << 20;
  setsockopt(fd_, SOL_SOCKET, SO_RCVBUF, &sz, sizeof sz);
  setsockopt(fd_, SOL_SOCKET, SO_SNDBUF, &sz, sizeof sz);
  static std::atomic<uint32_t> counter{0};
  std::random_device rd;
  for (int attempt = 0; attempt < 8; ++attempt) {
    addr_ = "nixl-node." + std::to_string(getpid()) + "." + std::to_string(counter++) + "." + std::to_string(rd());
    sockaddr_un sa;
    socklen_t len = fillAddr(addr_, &sa);
    if (bind(fd_, reinterpret_cast<sockaddr*>(&sa), len) == 0) {
      buf_.resize(kMaxMsg + 512);
      return;
    }
  }
  int e = errno;
  close(fd_);
  throw EngineError(ERR_BACKEND, std::string("notif socket bind: ") + strerror(e));
}

NotifSocket::~NotifSocket() {
  if (fd_ >= 0) close(fd_);
}

int NotifSocket::send(const std::string& to, const std::string& from, const std::string& msg) const {
  // Frame: u16 sender-name length, sender name, message.
  std::string frame;
  frame.reserve(2 + from.size() + msg.size());
  uint16_t n = static_cast<uint16_t>(from.size());
  frame.append(reinterpret_cast<const char*>(&n), 2);
  frame.append(from);
  frame.append(msg);
  sockaddr_un sa;
  socklen_t len = fillAddr(to, &sa);
  for (;;) {
    ssize_t r =
        sendto(fd_, frame.data(), frame.size(), MSG_NOSIGNAL | MSG_DONTWAIT, reinterpret_cast<sockaddr*>(&sa), len);
    if (r >= 0) return 0;
    if (errno != EINTR) return errno;
  }
}

bool NotifSocket::recv(std::string* from, std::string* msg) {
  for (;;) {
    ssize_t r = ::recv(fd_, buf_.data(), buf_.size(), MSG_DONTWAIT);
    if (r < 0) {
      if (errno == EINTR) continue;
      return false;
    }
    if (r < 2) continue;
    uint16_t n;
    memcpy(&n, buf_.data(), 2);
    if (static_cast<size_t>(r) < 2u + n) continue;
    from->assign(buf_.data() + 2, n);
    msg->assign(buf_.data() + 2 + n, static_cast<size_t>(r) - 2 - n);
    return true;
  }
}

}  // namespace nixlnode
