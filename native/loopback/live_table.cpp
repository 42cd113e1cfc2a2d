#include "live_table.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <string>

#include "../status.h"

namespace nixlnode::loopback {
namespace {
constexpr size_t kWordBytes = LiveTable::kSlots * sizeof(uint64_t);
// Words, then [addr, len] per slot; sparse: pages appear when touched.
constexpr size_t kBytes = kWordBytes * 3;
}  // namespace

LiveTable::LiveTable() {
  fd_ = memfd_create("nixl-node-live", MFD_CLOEXEC);
  if (fd_ < 0) throw EngineError(ERR_BACKEND, std::string("live table: memfd_create: ") + strerror(errno));
  void* p = MAP_FAILED;
  if (ftruncate(fd_, static_cast<off_t>(kBytes)) == 0)
    p = mmap(nullptr, kBytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd_, 0);
  if (p == MAP_FAILED) {
    int e = errno;
    close(fd_);
    throw EngineError(ERR_BACKEND, std::string("live table: ") + strerror(e));
  }
  words_ = static_cast<std::atomic<uint64_t>*>(p);
  extents_ = words_ + kSlots;
  struct stat st {};
  fstat(fd_, &st);
  ino_ = static_cast<uint64_t>(st.st_ino);
}

LiveTable::~LiveTable() {
  munmap(words_, kBytes);
  close(fd_);
}

LiveTable::Slot LiveTable::acquire(uint64_t addr, uint64_t len) {
  std::lock_guard<std::mutex> lk(mu_);
  uint32_t i;
  if (!free_.empty()) {
    i = free_.back();
    free_.pop_back();
  } else if (next_ < kSlots) {
    i = next_++;
  } else {
    throw EngineError(ERR_NOT_ALLOWED, "registerMem: more than " + std::to_string(kSlots) +
                                           " registrations alive at once; deregister some first");
  }
  // The generation lives in the word itself: a reused slot never repeats a word.
  uint64_t word = ((words_[i].load(std::memory_order_relaxed) >> 1) + 1) << 1 | 1;
  // The range before the word that makes it live: a reader that sees the
  // word sees the range (and re-reads the word after, as for a copy).
  extents_[2 * size_t{i}].store(addr, std::memory_order_relaxed);
  extents_[2 * size_t{i} + 1].store(len, std::memory_order_relaxed);
  words_[i].store(word, std::memory_order_seq_cst);
  return Slot{i, word};
}

void LiveTable::kill(uint32_t i) {
  std::lock_guard<std::mutex> lk(mu_);
  uint64_t w = words_[i].load(std::memory_order_relaxed);
  if (!(w & 1)) return;
  words_[i].store(w & ~uint64_t{1}, std::memory_order_seq_cst);
  free_.push_back(i);
}

void LiveTable::killAll() {
  std::lock_guard<std::mutex> lk(mu_);
  for (uint32_t i = 0; i < next_; ++i) {
    uint64_t w = words_[i].load(std::memory_order_relaxed);
    if (w & 1) words_[i].store(w & ~uint64_t{1}, std::memory_order_seq_cst);
  }
}

LiveView::LiveView(uint32_t pid, int32_t fd, uint64_t ino) {
  std::string path = "/proc/" + std::to_string(pid) + "/fd/" + std::to_string(fd);
  int f = open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (f < 0)
    throw EngineError(ERR_NOT_ALLOWED, "cannot open the peer's registration table (" + path + "): " + strerror(errno) +
                                           "; the loopback engine needs ptrace access to peers (same user)");
  struct stat st {};
  if (fstat(f, &st) != 0 || static_cast<uint64_t>(st.st_ino) != ino || static_cast<uint64_t>(st.st_size) < kBytes) {
    close(f);
    throw EngineError(ERR_REMOTE_DISCONNECT,
                      "the peer's registration table is gone (agent closed or process restarted)");
  }
  void* p = mmap(nullptr, kBytes, PROT_READ, MAP_SHARED, f, 0);
  int e = errno;
  close(f);
  if (p == MAP_FAILED)
    throw EngineError(ERR_BACKEND, std::string("mapping the peer's registration table: ") + strerror(e));
  words_ = static_cast<const std::atomic<uint64_t>*>(p);
  extents_ = words_ + LiveTable::kSlots;
}

bool LiveView::covers(uint32_t index, uint64_t word, uint64_t addr, uint64_t len, uint64_t reg[2]) const {
  if (!alive(index, word)) return false;
  reg[0] = extents_[2 * size_t{index}].load(std::memory_order_relaxed);
  reg[1] = extents_[2 * size_t{index} + 1].load(std::memory_order_relaxed);
  std::atomic_thread_fence(std::memory_order_acquire);
  if (!alive(index, word)) return false;  // reused meanwhile: the range may be another's
  return addr >= reg[0] && len <= reg[1] && addr - reg[0] <= reg[1] - len;
}

LiveView::~LiveView() { munmap(const_cast<std::atomic<uint64_t>*>(words_), kBytes); }

}  // namespace nixlnode::loopback
