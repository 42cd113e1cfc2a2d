// Shared memory for allocate(): a memfd mapped MAP_SHARED, so a peer process on
// the same host can map the very same pages from the agent metadata
// (/proc/<pid>/fd/<fd>) and copy with plain memcpy instead of a syscall.
#pragma once
#include <cstddef>
#include <cstdint>

namespace nixlnode::shm {

struct Info {
  int fd;
  uint64_t offset;  // of the looked-up address inside the memfd
  uint64_t size;    // of the whole memfd
  uint64_t ino;     // inode, so a peer can tell a reused fd number apart
};

// Page-aligned, zero-filled; throws EngineError on failure.
void* allocate(size_t bytes);
void release(void* base);
// True when [addr, addr+len) lies inside one allocation.
bool lookup(uint64_t addr, uint64_t len, Info* out);

// A peer's allocate() memory mapped here: `at` is the peer's region start.
struct Mapping {
  void* base = nullptr;
  size_t len = 0;
  char* at = nullptr;
};
// Maps [offset, offset+len) of memfd `fd` of process `pid` if it is still the
// memfd with inode `ino`; false (nothing mapped) otherwise.
bool mapPeer(uint32_t pid, int32_t fd, uint64_t ino, uint64_t offset, uint64_t len, Mapping* out);
void unmap(const Mapping& m);

}  // namespace nixlnode::shm
