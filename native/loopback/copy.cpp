// Moving the bytes of one request, on the agent's worker thread. Every
// descriptor was resolved against registered memory when the request was
// made; what can change since is the peer: closed, or its memory deregistered.
#include "copy.h"

#include <sys/uio.h>

#include <cerrno>
#include <cstdint>
#include <cstring>

#include "stream_copy.h"

namespace nixlnode::loopback {
namespace {

int checkRemoteLive(const Request& req, std::string* err);

// One descriptor pair on memory this process maps (its own, or a peer's
// memfd): ranges that overlap (the same memory registered by both agents)
// are copied as memmove would, never as an overlapping memcpy (undefined
// byte order; ASan's memcpy-param-overlap).
void copyOne(char* dst, const char* src, size_t n) {
  const auto d = reinterpret_cast<uintptr_t>(dst);
  const auto s = reinterpret_cast<uintptr_t>(src);
  if (d < s + n && s < d + n)
    memmove(dst, src, n);
  else
    streamCopy(dst, src, n);
}

int copyBytes(Request& req, std::string* err) {
  const bool read = req.op == XferOp::READ;
  constexpr size_t kBatch = 64;
  iovec liov[kBatch], riov[kBatch];
  size_t n = 0, want = 0;
  auto flush = [&]() -> int {
    if (n == 0) return SUCCESS;
    ssize_t r = read ? process_vm_readv(static_cast<pid_t>(req.remote->pid), liov, n, riov, n, 0)
                     : process_vm_writev(static_cast<pid_t>(req.remote->pid), liov, n, riov, n, 0);
    int e = errno;
    n = 0;
    if (r == static_cast<ssize_t>(want)) return SUCCESS;
    if (r < 0 && e == ESRCH) {
      *err = "agent '" + req.remote->name + "' process exited";
      return ERR_REMOTE_DISCONNECT;
    }
    *err = std::string(read ? "process_vm_readv" : "process_vm_writev") + ": " +
           (r < 0 ? strerror(e) : "short transfer (remote memory unmapped?)");
    return ERR_BACKEND;
  };
  for (size_t i = 0; i < req.local.size(); ++i) {
    const Entry& l = req.local[i];
    const Entry& r = req.remote_[i];
    if (r.ptr) {
      if (read)
        copyOne(l.ptr, r.ptr, l.d.len);
      else
        copyOne(r.ptr, l.ptr, l.d.len);
      continue;
    }
    if (n == 0) want = 0;
    liov[n] = iovec{l.ptr, l.d.len};
    riov[n] = iovec{reinterpret_cast<void*>(r.d.addr), r.d.len};
    want += l.d.len;
    if (++n == kBatch) {
      int s = flush();
      if (s != SUCCESS) return s;
    }
  }
  int s = flush();
  if (!req.deferFence) streamFence();
  return s;
}

// The peer's memory is JS memory of this process: hold its registry's copy
// count while copying, so that closing the peer waits for us.
int copySameProcess(Request& req, std::string* err) {
  auto reg = req.remote->registry.lock();
  if (!reg) {
    *err = "agent '" + req.remote->name + "' is closed";
    return ERR_REMOTE_DISCONNECT;
  }
  {
    std::lock_guard<std::mutex> lk(reg->mu);
    for (const auto& e : req.remote_)
      if (!e.region->live) {
        *err = "agent '" + req.remote->name + "' was closed before the transfer ran";
        return ERR_REMOTE_DISCONNECT;
      }
    ++reg->copying;
  }
  int s = copyBytes(req, err);
  {
    std::lock_guard<std::mutex> lk(reg->mu);
    --reg->copying;
  }
  reg->idle.notify_all();
  return s;
}

// The peer may deregister (and reuse) its memory or close at any time: check
// its liveness words before the copy and again after it, so a copy that
// overlapped either fails rather than returning the bytes that replaced it.
int copyOtherProcess(Request& req, std::string* err) {
  int s = checkRemoteLive(req, err);
  if (s != SUCCESS) return s;
  s = copyBytes(req, err);
  std::atomic_thread_fence(std::memory_order_acquire);
  int after = checkRemoteLive(req, err);
  return s != SUCCESS ? s : after;
}

int checkRemoteLive(const Request& req, std::string* err) {
  const RemoteAgent& ra = *req.remote;
  if (!ra.live->alive(0, ra.agentWord)) {
    *err = "agent '" + ra.name + "' was closed";
    return ERR_REMOTE_DISCONNECT;
  }
  for (size_t i : req.liveChecks)
    if (const Entry& e = req.remote_[i]; !ra.live->alive(e.liveSlot, e.liveWord)) {
      *err = "memory " + descStr(e.d) + " of agent '" + ra.name + "' was deregistered";
      return ERR_NOT_FOUND;
    }
  return SUCCESS;
}

}  // namespace

int copyRequest(Request& req, std::string* err) {
  return req.remote->sameProcess ? copySameProcess(req, err) : copyOtherProcess(req, err);
}

}  // namespace nixlnode::loopback
