#include "shm.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <map>
#include <mutex>
#include <string>

#include "../status.h"

namespace nixlnode::shm {
namespace {

struct Allocation {
  size_t size;
  int fd;
  uint64_t ino;
};

std::mutex gMu;
std::map<uint64_t, Allocation> gAllocs;  // base address -> allocation

}  // namespace

void* allocate(size_t bytes) {
  if (bytes == 0) throw EngineError(ERR_INVALID_PARAM, "allocate: size must be > 0");
  const size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
  const size_t size = (bytes + page - 1) / page * page;
  int fd = memfd_create("nixl-node", MFD_CLOEXEC);
  if (fd < 0) throw EngineError(ERR_BACKEND, std::string("memfd_create: ") + strerror(errno));
  if (ftruncate(fd, static_cast<off_t>(size)) != 0) {
    int e = errno;
    close(fd);
    throw EngineError(ERR_BACKEND, std::string("ftruncate: ") + strerror(e));
  }
  void* p = mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (p == MAP_FAILED) {
    int e = errno;
    close(fd);
    throw EngineError(ERR_BACKEND, "allocate(" + std::to_string(bytes) + "): mmap: " + strerror(e));
  }
  struct stat st {};
  fstat(fd, &st);
  std::lock_guard<std::mutex> lk(gMu);
  gAllocs[reinterpret_cast<uint64_t>(p)] = Allocation{size, fd, static_cast<uint64_t>(st.st_ino)};
  return p;
}

void release(void* base) {
  Allocation a{};
  {
    std::lock_guard<std::mutex> lk(gMu);
    auto it = gAllocs.find(reinterpret_cast<uint64_t>(base));
    if (it == gAllocs.end()) return;
    a = it->second;
    gAllocs.erase(it);
  }
  munmap(base, a.size);
  close(a.fd);
}

bool lookup(uint64_t addr, uint64_t len, Info* out) {
  std::lock_guard<std::mutex> lk(gMu);
  auto it = gAllocs.upper_bound(addr);
  if (it == gAllocs.begin()) return false;
  --it;
  const uint64_t base = it->first;
  if (addr + len > base + it->second.size) return false;
  *out = Info{it->second.fd, addr - base, it->second.size, it->second.ino};
  return true;
}

bool mapPeer(uint32_t pid, int32_t fd, uint64_t ino, uint64_t offset, uint64_t len, Mapping* out) {
  std::string path = "/proc/" + std::to_string(pid) + "/fd/" + std::to_string(fd);
  int f = open(path.c_str(), O_RDWR | O_CLOEXEC);
  if (f < 0) return false;
  struct stat st {};
  // The offsets come from the peer's metadata: no sum may wrap.
  if (fstat(f, &st) != 0 || static_cast<uint64_t>(st.st_ino) != ino || st.st_size < 0 ||
      offset > static_cast<uint64_t>(st.st_size) || len > static_cast<uint64_t>(st.st_size) - offset) {
    close(f);
    return false;
  }
  const uint64_t page = static_cast<uint64_t>(sysconf(_SC_PAGESIZE));
  uint64_t off = offset / page * page;
  size_t n = static_cast<size_t>(offset + len - off);
  // MAP_POPULATE: page tables up front, as an RDMA registration would pin.
  void* p = mmap(nullptr, n, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, f, static_cast<off_t>(off));
  close(f);
  if (p == MAP_FAILED) return false;
  *out = Mapping{p, n, static_cast<char*>(p) + (offset - off)};
  return true;
}

void unmap(const Mapping& m) {
  if (m.base) munmap(m.base, m.len);
}

}  // namespace nixlnode::shm
