// Cross-process liveness of registrations. Each agent owns a table in a memfd:
// one 64-bit word per registration, (generation << 1) | live. Deregistration
// and close store a dead word *before* returning to the caller, who may then
// reuse the memory; a reader in another process maps the table read-only and
// compares the word its metadata announced before and after each copy, so a
// copy that overlapped a deregistration fails instead of handing back the
// bytes that replaced the memory (a seqlock, with the owner as the writer).
// Beside each word the owner writes the registered range itself, so a reader
// bounds what a peer's metadata claims by what the peer really registered
// (metadata comes over a side channel, and can be tampered with).
#pragma once
#include <atomic>
#include <cstdint>
#include <mutex>
#include <vector>

namespace nixlnode::loopback {

// The owner's side.
class LiveTable {
 public:
  static constexpr uint32_t kSlots = 1u << 20;  // registrations alive at once

  LiveTable();  // throws EngineError
  ~LiveTable();
  LiveTable(const LiveTable&) = delete;
  LiveTable& operator=(const LiveTable&) = delete;

  struct Slot {
    uint32_t index;
    uint64_t word;  // what readers must see while the registration lives
  };
  // One registered range; throws EngineError(ERR_NOT_ALLOWED) when full.
  Slot acquire(uint64_t addr = 0, uint64_t len = 0);
  void kill(uint32_t index);  // dead at once; the slot may be reused later
  void killAll();

  int fd() const { return fd_; }
  uint64_t ino() const { return ino_; }

 private:
  std::atomic<uint64_t>* words_ = nullptr;
  std::atomic<uint64_t>* extents_ = nullptr;  // [addr, len] per slot, after the words
  int fd_ = -1;
  uint64_t ino_ = 0;
  std::mutex mu_;
  uint32_t next_ = 0;
  std::vector<uint32_t> free_;
};

// A reader's read-only mapping of a peer's table.
class LiveView {
 public:
  // Maps /proc/<pid>/fd/<fd> if its inode matches; throws EngineError otherwise.
  LiveView(uint32_t pid, int32_t fd, uint64_t ino);
  ~LiveView();
  LiveView(const LiveView&) = delete;
  LiveView& operator=(const LiveView&) = delete;

  bool alive(uint32_t index, uint64_t word) const {
    return index < LiveTable::kSlots && words_[index].load(std::memory_order_acquire) == word;
  }

  // Whether registration (index, word) is alive and [addr, addr + len) lies
  // inside the range its owner registered; *reg gets that range.
  bool covers(uint32_t index, uint64_t word, uint64_t addr, uint64_t len, uint64_t reg[2]) const;

 private:
  const std::atomic<uint64_t>* words_ = nullptr;
  const std::atomic<uint64_t>* extents_ = nullptr;
};

}  // namespace nixlnode::loopback
