// Whether the local memory of a request is resident, checked before its
// first post is predicted inline from another request's time (PostRate in
// engine.h). A copy into pages never touched faults each one in, about
// 2.5 us per 4 KiB page on the development VM (1.3 ms for 2 MiB, where the
// copy itself takes about 60-140 us), and a sample taken on warm pages does
// not predict that. A KV pool handed out from allocate() (a memfd) or a large
// Buffer (anonymous memory) stays untouched until its blocks are first used.
#pragma once
#include <sys/mman.h>
#include <unistd.h>

#include <cstdint>
#include <utility>
#include <vector>

namespace nixlnode {

class LocalPages {
 public:
  // More ranges than this (after merging adjacent ones) are not checked, and
  // such a request is never predicted: the check must stay cheaper than the
  // hop to the engine's thread that it saves.
  static constexpr size_t kMaxRanges = 16;

  void add(uint64_t addr, uint64_t len) {
    if (tooMany_ || len == 0) return;
    if (!ranges_.empty() && ranges_.back().first + ranges_.back().second == addr) {
      ranges_.back().second += len;
      return;
    }
    if (ranges_.size() == kMaxRanges) {
      tooMany_ = true;
      ranges_.clear();
      return;
    }
    ranges_.emplace_back(addr, len);
  }

  // Every page of every range resident now (mincore); false when a range is
  // not mapped (device memory included) or there were too many to check.
  bool resident() const {
    if (tooMany_ || ranges_.empty()) return false;
    static const uint64_t page = static_cast<uint64_t>(sysconf(_SC_PAGESIZE));
    constexpr uint64_t kChunkPages = 4096;
    unsigned char vec[kChunkPages];
    for (const auto& [addr, len] : ranges_) {
      uint64_t start = addr & ~(page - 1);
      uint64_t pages = (addr + len - start + page - 1) / page;
      for (uint64_t done = 0; done < pages; done += kChunkPages) {
        uint64_t n = pages - done < kChunkPages ? pages - done : kChunkPages;
        if (mincore(reinterpret_cast<void*>(start + done * page), n * page, vec) != 0) return false;
        for (uint64_t i = 0; i < n; i++)
          if (!(vec[i] & 1)) return false;
      }
    }
    return true;
  }

 private:
  std::vector<std::pair<uint64_t, uint64_t>> ranges_;
  bool tooMany_ = false;
};

}  // namespace nixlnode
