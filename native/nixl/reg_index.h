// Which of this agent's registrations cover a descriptor. NIXL resolves a
// local descriptor to a registration's memory handle once, when the list is
// prepared or the request made, and never looks again: a request kept past
// deregisterMem would post with a freed handle. The NIXL engine records the
// registrations each list and request covers, refuses to deregister one that
// a queued or running transfer uses, and refuses to post a request whose
// registrations are gone (even if the same bytes were registered again).
#pragma once

#include <algorithm>
#include <cstdint>
#include <vector>

#include "../engine.h"

namespace nixlnode {

class RegIndex {
 public:
  void add(Handle reg, const std::vector<Desc>& descs, MemType type) {
    for (const auto& d : descs) {
      if (d.len == 0 || descWraps(d.addr, d.len)) continue;  // NIXL refuses these itself
      ranges_.push_back(Range{d.addr, d.addr + d.len, d.devId, type, reg});
      maxLen_ = std::max(maxLen_, d.len);
    }
    std::sort(ranges_.begin(), ranges_.end(), [](const Range& a, const Range& b) { return a.start < b.start; });
  }

  void remove(Handle reg) {
    std::erase_if(ranges_, [reg](const Range& r) { return r.reg == reg; });
  }

  // Appends every registration that contains all of d (several when the same
  // bytes are registered more than once: NIXL may have picked any of them).
  void covering(const Desc& d, MemType type, std::vector<Handle>& out) const {
    if (d.len == 0 || descWraps(d.addr, d.len)) return;
    const uint64_t end = d.addr + d.len;
    // Ranges start at or before d.addr; none longer than maxLen_ reaches end
    // from further back.
    auto it = std::upper_bound(ranges_.begin(), ranges_.end(), d.addr,
                               [](uint64_t a, const Range& r) { return a < r.start; });
    while (it != ranges_.begin()) {
      --it;
      if (end - it->start > maxLen_) break;
      if (it->end >= end && it->type == type && it->devId == d.devId) out.push_back(it->reg);
    }
  }

  // The registrations covering descs (or the subset named by idx), each once.
  std::vector<Handle> covering(const std::vector<Desc>& descs, MemType type) const {
    std::vector<Handle> out;
    for (const auto& d : descs) covering(d, type, out);
    return unique(std::move(out));
  }

  static std::vector<Handle> unique(std::vector<Handle> v) {
    std::sort(v.begin(), v.end());
    v.erase(std::unique(v.begin(), v.end()), v.end());
    return v;
  }

 private:
  struct Range {
    uint64_t start, end, devId;
    MemType type;
    Handle reg;
  };
  std::vector<Range> ranges_;  // sorted by start
  uint64_t maxLen_ = 0;
};

}  // namespace nixlnode
