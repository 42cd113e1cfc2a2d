// The loopback engine's data model: registered regions (with the registry
// that same-process peers share), what is known of remote agents, prepared
// descriptor lists and transfer requests. loopback_engine.cpp implements the
// agent on it; copy.cpp moves the bytes of a request.
#pragma once
#include <poll.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <memory>
#include <mutex>
#include <sstream>
#include <string>
#include <vector>

#include "../engine.h"
#include "live_table.h"
#include "metadata.h"
#include "shm.h"

namespace nixlnode::loopback {

using Clock = std::chrono::steady_clock;

// "[0x..., +len, dev n]", for error messages.
inline std::string descStr(const Desc& d) {
  std::ostringstream os;
  os << "[0x" << std::hex << d.addr << std::dec << ", +" << d.len << ", dev " << d.devId << "]";
  return os.str();
}

struct Region {
  Desc d;
  MemType type;
  shm::Info shm{-1, 0, 0, 0};
  LiveTable::Slot liveSlot{0, 0};  // its registration's, for peers in other processes
  std::atomic<int> inUse{0};       // in-flight requests touching it
  bool live = true;                // guarded by Registry::mu
};
using RegionP = std::shared_ptr<Region>;

// An agent's registered memory. Shared with agents of the same process, which
// check liveness and pin regions directly.
struct Registry {
  std::mutex mu;
  std::vector<RegionP> regions;  // sorted by address
  // Copies by any agent of this process running on this memory right now;
  // close waits for them (the JS memory goes when it returns).
  int copying = 0;
  std::condition_variable idle;

  // Caller holds mu. Regions may overlap, so walk back over every region
  // starting at or below addr.
  RegionP find(const Desc& d, MemType type) const {
    auto it = std::upper_bound(regions.begin(), regions.end(), d.addr,
                               [](uint64_t a, const RegionP& r) { return a < r->d.addr; });
    while (it != regions.begin()) {
      --it;
      const Region& r = **it;
      if (descWithin(d.addr, d.len, r.d.addr, r.d.len) && r.d.devId == d.devId && r.type == type) return *it;
    }
    return nullptr;
  }
};

struct RemoteRegion {
  MdRegion r;
  shm::Mapping mapping;    // our mapping of the peer's memfd, if any
  char* mapped = nullptr;  // start of r inside it; null: process_vm_*
};

struct RemoteAgent {
  std::string name;
  uint32_t pid = 0;
  std::string notifAddr;
  bool sameProcess = false;
  std::weak_ptr<Registry> registry;  // same process only
  std::unique_ptr<LiveView> live;    // other processes: their registrations' liveness
  uint64_t agentWord = 0;
  std::vector<RemoteRegion> regions;  // sorted by address
  int pidfd = -1;
  uint64_t startTime = 0;  // the process's start time, as its metadata said (/proc/<pid>/stat)
  std::atomic<bool> removed{false};
  // What copies to or from it cost (every timed one that succeeded): the
  // first post of a request to it, never timed, is predicted from it. By
  // path: [0] memcpy (same process, or its allocate() memory mapped here),
  // [1] process_vm_readv/writev (its other memory), 3-4 times slower per
  // byte, so a sample of one never predicts the other (Request::viaSyscall).
  // A removed agent's go with it: loading it again makes a new RemoteAgent.
  PostRate rate[2];

  ~RemoteAgent() {
    for (auto& r : regions) shm::unmap(r.mapping);
    if (pidfd >= 0) close(pidfd);
  }

  bool processAlive() const {
    if (sameProcess) return !registry.expired();
    if (pidfd < 0) return true;
    pollfd p{pidfd, POLLIN, 0};
    if (poll(&p, 1, 0) == 0) return true;  // not readable: not exited
    // Readable (exited), or the poll itself failed (POLLNVAL, an error): /proc
    // decides, and also tells a pid reused by another process.
    return loopback::processStartTime(pid) == startTime;
  }

  const RemoteRegion* find(const Desc& d, MemType type) const {
    auto it = std::upper_bound(regions.begin(), regions.end(), d.addr,
                               [](uint64_t a, const RemoteRegion& r) { return a < r.r.addr; });
    while (it != regions.begin()) {
      --it;
      const auto& r = it->r;
      if (descWithin(d.addr, d.len, r.addr, r.len) && r.devId == d.devId && r.type == type) return &*it;
    }
    return nullptr;
  }
};
using RemoteP = std::shared_ptr<RemoteAgent>;

struct Entry {
  Desc d;
  RegionP region;         // local, or a same-process peer's; null for other processes
  char* ptr;              // where to memcpy; null: use process_vm_*
  uint32_t liveSlot = 0;  // other processes: the word that says the region is still registered
  uint64_t liveWord = 0;
};

struct Dlist {
  RemoteP remote;  // null: local
  MemType type;
  std::vector<Entry> entries;
};

struct Request {
  Handle id;
  XferOp op;
  RemoteP remote;
  std::vector<Entry> local, remote_;
  uint64_t totalBytes = 0;
  bool viaSyscall = false;  // some remote entry is copied with process_vm_*: its rate is remote->rate[1]
  LocalPages pages;         // its local memory, checked before a first post is predicted (expectedPostUs)
  // How long its last copy took, timed when over EngineConfig::inlineMaxBytes.
  std::atomic<uint32_t> copyUs{kPostUsUnknown};
  bool hasNotif = false;
  std::string notif;
  std::atomic<int> status{ERR_NOT_POSTED};
  std::string err;  // written before status is stored
  std::atomic<bool> released{false};
  bool pinned = false;          // posted and not yet run: holds inUse on its regions
  bool pinnedLocal = false;     // ... this agent's too (not when run inline: see pin)
  bool deferFence = false;      // this posting's streamed stores are fenced by a later post (copy.h)
  bool checkPeer = true;        // this posting checks that the peer's process lives (see Engine::postXferReq)
  bool localOneRegion = false;  // every local entry lies in the same region: one liveness check
  // Other processes: each distinct registration the remote entries use, once
  // (index of its first entry), so the liveness check costs per registration,
  // not per descriptor. Filled when the request is made.
  std::vector<size_t> liveChecks;
  Telemetry tel{};
  Clock::time_point postedAt;
};
using RequestP = std::shared_ptr<Request>;

}  // namespace nixlnode::loopback
