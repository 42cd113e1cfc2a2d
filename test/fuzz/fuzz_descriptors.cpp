// libFuzzer target: descriptor validation in the loopback engine, below the
// addon's own checks. Two agents in this process, each with registered
// buffers fenced by canaries; the input picks descriptors (a base, a signed
// offset from it, a length: anything, wrapping ones included), makes a
// request and runs it. A descriptor that is not inside registered memory
// must be refused before any byte moves; ASan reports any stray access and
// the canaries any stray write.
#include <condition_variable>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <vector>

#include "../../native/engine.h"

using namespace nixlnode;

namespace {

constexpr size_t kBuf = 4096, kCanary = 64;
constexpr uint8_t kCanaryByte = 0xa5;

struct Sink : CompletionSink {
  std::mutex mu;
  std::condition_variable cv;
  std::set<Handle> done;
  void onComplete(Handle h) override {
    std::lock_guard<std::mutex> lk(mu);
    done.insert(h);
    cv.notify_all();
  }
  void onCompleteHere(Handle) override {}
  void onNotif() override {}
  void await(Handle h) {
    std::unique_lock<std::mutex> lk(mu);
    cv.wait(lk, [&] { return done.count(h) > 0; });
    done.erase(h);
  }
};

struct Side {
  Sink sink;
  std::unique_ptr<Engine> engine;
  std::vector<std::vector<uint8_t>> mem;  // canary | kBuf | canary
  uint64_t base(size_t i) const { return reinterpret_cast<uint64_t>(mem[i].data()) + kCanary; }
  Side(const char* name) {
    // Transfers up to half a buffer run inline on this thread, larger ones on the worker: both paths.
    EngineConfig cfg{{"LOOPBACK"}};
    cfg.inlineMaxBytes = kBuf / 2;
    engine = makeLoopbackEngine(name, cfg, &sink);
    for (int i = 0; i < 2; ++i) {
      mem.emplace_back(kBuf + 2 * kCanary, kCanaryByte);
      engine->registerMem({Desc{base(i), kBuf, 0}}, MemType::DRAM, {});
    }
  }
  bool canariesIntact() const {
    for (const auto& m : mem)
      for (size_t k = 0; k < kCanary; ++k)
        if (m[k] != kCanaryByte || m[m.size() - 1 - k] != kCanaryByte) return false;
    return true;
  }
};

struct World {
  Side a{"fuzz-a"}, b{"fuzz-b"};
  World() { a.engine->loadRemoteMD(b.engine->getLocalMD()); }
};

struct Reader {
  const uint8_t* p;
  size_t n;
  template <class T>
  T get() {
    T v{};
    size_t k = n < sizeof(T) ? n : sizeof(T);
    memcpy(&v, p, k);
    p += k;
    n -= k;
    return v;
  }
};

Desc pick(Reader& r, const Side& s) {
  // Mostly near the buffers, where the edges are; the selector's high bits
  // ask for a full 64-bit offset or length instead.
  uint8_t which = r.get<uint8_t>();
  int64_t off = (which & 0x80) ? r.get<int64_t>() : r.get<int16_t>();
  uint64_t len = (which & 0x40) ? r.get<uint64_t>() : r.get<uint16_t>();
  uint64_t base = s.base(which & 1);
  return Desc{base + static_cast<uint64_t>(off), len, (which & 0x20) ? 1u : 0u};
}

bool inside(const Desc& d, const Side& s) {
  for (size_t i = 0; i < s.mem.size(); ++i)
    if (d.devId == 0 && d.len > 0 && descWithin(d.addr, d.len, s.base(i), kBuf)) return true;
  return false;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static World* w = new World();  // engines live for the whole run
  Reader r{data, size};
  XferOp op = (r.get<uint8_t>() & 1) ? XferOp::WRITE : XferOp::READ;
  size_t n = 1 + r.get<uint8_t>() % 4;
  std::vector<Desc> local, remote;
  bool allInside = true;
  for (size_t i = 0; i < n; ++i) {
    local.push_back(pick(r, w->a));
    remote.push_back(pick(r, w->b));
    allInside =
        allInside && inside(local.back(), w->a) && inside(remote.back(), w->b) && local.back().len == remote.back().len;
  }
  // Each side on its own (prepXferDlist), then the request.
  auto prepOk = [&](const std::string& agent, const std::vector<Desc>& d) {
    try {
      w->a.engine->releaseDlist(w->a.engine->prepXferDlist(agent, d, MemType::DRAM, {}));
      return true;
    } catch (const EngineError&) {
      return false;
    }
  };
  auto allIn = [](const std::vector<Desc>& d, const Side& s) {
    for (const auto& x : d)
      if (!inside(x, s)) return false;
    return true;
  };
  if (prepOk("", local) != allIn(local, w->a)) abort();
  if (prepOk("fuzz-b", remote) != allIn(remote, w->b)) abort();
  Handle h = 0;
  try {
    h = w->a.engine->createXferReq(op, local, MemType::DRAM, remote, MemType::DRAM, "fuzz-b", nullptr);
  } catch (const EngineError&) {
    if (allInside) abort();  // a valid request must be accepted
    return 0;
  }
  if (!allInside) abort();  // an invalid one must not
  if (w->a.engine->postXferReq(h, nullptr) == IN_PROG) w->a.sink.await(h);
  if (w->a.engine->getXferStatus(h, nullptr) != SUCCESS) abort();
  w->a.engine->releaseXferReq(h);
  if (!w->a.canariesIntact() || !w->b.canariesIntact()) abort();
  return 0;
}
