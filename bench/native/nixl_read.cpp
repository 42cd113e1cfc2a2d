// The native baseline for `npm run bench`: the same prepped READs as the
// binding's nixl rows, between two processes, written straight against
// libnixl. Built by bench/native.ts only when an installed NIXL is found.
//
//   nixl_read --block BYTES --count N --reps R [--scatter] [--skip-merge]
//
// --scatter reads every other remote block, so no two descriptors are
// contiguous and NIXL cannot merge them; --skip-merge sets skipDescMerge.
// Prints one JSON line: medians and ranges of GB/s and of the post call.
#include <nixl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

namespace {

using Clock = std::chrono::steady_clock;

void die(const char* what, nixl_status_t s) {
  std::fprintf(stderr, "nixl_read: %s: %s\n", what, nixlEnumStrings::statusStr(s).c_str());
  std::exit(1);
}

void ok(nixl_status_t s, const char* what) {
  if (s != NIXL_SUCCESS && s != NIXL_IN_PROG) die(what, s);
}

void writeBlob(int fd, const std::string& b) {
  uint64_t n = b.size();
  if (write(fd, &n, sizeof n) != sizeof n) std::exit(2);
  for (size_t off = 0; off < b.size();) {
    ssize_t w = write(fd, b.data() + off, b.size() - off);
    if (w <= 0) std::exit(2);
    off += static_cast<size_t>(w);
  }
}

std::string readBlob(int fd) {
  uint64_t n = 0;
  if (read(fd, &n, sizeof n) != sizeof n) std::exit(3);
  std::string b(n, '\0');
  for (size_t off = 0; off < n;) {
    ssize_t r = read(fd, b.data() + off, n - off);
    if (r <= 0) std::exit(3);
    off += static_cast<size_t>(r);
  }
  return b;
}

// One agent with a UCX backend, as the binding makes it (progress thread, RW sync).
nixlAgent* makeAgent(const char* name) {
  auto* a = new nixlAgent(name, nixlAgentConfig(true, false, 0, nixl_thread_sync_t::NIXL_THREAD_SYNC_RW, 1, 1000));
  nixl_b_params_t params;
  nixl_mem_list_t mems;
  ok(a->getPluginParams("UCX", mems, params), "getPluginParams");
  const char* tls = std::getenv("UCX_TLS");
  if (tls && std::strstr(tls, "sm")) params["ucx_error_handling_mode"] = "none";
  nixlBackendH* b = nullptr;
  ok(a->createBackend("UCX", params, b), "createBackend");
  return a;
}

// Registers the whole buffer; returns the list to deregister with.
nixl_reg_dlist_t registerAll(nixlAgent* a, std::vector<char>& mem) {
  nixl_reg_dlist_t reg(DRAM_SEG);
  reg.addDesc(nixlBlobDesc(reinterpret_cast<uintptr_t>(mem.data()), mem.size(), 0, ""));
  ok(a->registerMem(reg), "registerMem");
  return reg;
}

std::string localMD(nixlAgent* a) {
  std::string md;
  ok(a->getLocalMD(md), "getLocalMD");
  return md;
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0 : v[v.size() / 2];
}

}  // namespace

int main(int argc, char** argv) {
  size_t block = 64 << 10, count = 1024;
  int reps = 7;
  bool scatter = false, skipMerge = false;
  for (int i = 1; i < argc; i++) {
    std::string a = argv[i];
    if (a == "--block" && i + 1 < argc)
      block = std::strtoull(argv[++i], nullptr, 10);
    else if (a == "--count" && i + 1 < argc)
      count = std::strtoull(argv[++i], nullptr, 10);
    else if (a == "--reps" && i + 1 < argc)
      reps = std::atoi(argv[++i]);
    else if (a == "--scatter")
      scatter = true;
    else if (a == "--skip-merge")
      skipMerge = true;
    else {
      std::fprintf(stderr, "usage: nixl_read --block BYTES --count N --reps R [--scatter] [--skip-merge]\n");
      return 2;
    }
  }
  const size_t remoteBlocks = scatter ? 2 * count : count;
  int toChild[2], toParent[2];
  if (pipe(toChild) != 0 || pipe(toParent) != 0) return 2;
  pid_t pid = fork();
  if (pid == 0) {
    // Target: registered memory, and progress until told it is over.
    std::vector<char> mem(remoteBlocks * block, 0x5a);
    nixlAgent* t = makeAgent("native-target");
    nixl_reg_dlist_t reg = registerAll(t, mem);
    writeBlob(toParent[1], localMD(t));
    writeBlob(toParent[1], std::to_string(reinterpret_cast<uintptr_t>(mem.data())));
    std::string peerName;
    ok(t->loadRemoteMD(readBlob(toChild[0]), peerName), "loadRemoteMD (target)");
    for (;;) {
      nixl_notifs_t n;
      t->getNotifs(n);
      bool done = false;
      for (auto& [from, msgs] : n)
        for (auto& m : msgs) done |= m == "done";
      if (done) break;
      std::this_thread::sleep_for(std::chrono::microseconds(100));
    }
    t->deregisterMem(reg);
    delete t;
    _exit(0);
  }
  std::vector<char> mem(count * block, 0);
  nixlAgent* a = makeAgent("native-initiator");
  nixl_reg_dlist_t reg = registerAll(a, mem);
  const std::string md = localMD(a);
  std::string target;
  std::string tmd = readBlob(toParent[0]);
  const uintptr_t rbase = std::strtoull(readBlob(toParent[0]).c_str(), nullptr, 10);
  writeBlob(toChild[1], md);
  ok(a->loadRemoteMD(tmd, target), "loadRemoteMD");

  nixl_xfer_dlist_t local(DRAM_SEG), remote(DRAM_SEG);
  for (size_t i = 0; i < count; i++)
    local.addDesc(nixlBasicDesc(reinterpret_cast<uintptr_t>(mem.data()) + i * block, block, 0));
  for (size_t j = 0; j < remoteBlocks; j++) remote.addDesc(nixlBasicDesc(rbase + j * block, block, 0));
  nixlDlistH *lh = nullptr, *rh = nullptr;
  ok(a->prepXferDlist(NIXL_INIT_AGENT, local, lh), "prepXferDlist (local)");
  ok(a->prepXferDlist(target, remote, rh), "prepXferDlist (remote)");
  std::vector<int> li(count), ri(count);
  for (size_t i = 0; i < count; i++) {
    li[i] = static_cast<int>(i);
    ri[i] = static_cast<int>(scatter ? 2 * i : i);
  }
  nixl_opt_args_t opts;
  opts.skipDescMerge = skipMerge;
  nixlXferReqH* req = nullptr;
  ok(a->makeXferReq(NIXL_READ, lh, li, rh, ri, req, &opts), "makeXferReq");

  std::vector<double> gbps, postUs;
  for (int r = -1; r < reps; r++) {  // r = -1: warm-up
    auto t0 = Clock::now();
    nixl_status_t s = a->postXferReq(req);
    auto t1 = Clock::now();
    ok(s, "postXferReq");
    while (s == NIXL_IN_PROG) s = a->getXferStatus(req);
    ok(s, "getXferStatus");
    auto t2 = Clock::now();
    if (r < 0) continue;
    gbps.push_back(static_cast<double>(count * block) / std::chrono::duration<double, std::nano>(t2 - t0).count());
    postUs.push_back(std::chrono::duration<double, std::micro>(t1 - t0).count());
  }
  if (mem[0] != 0x5a || mem[mem.size() - 1] != 0x5a) {
    std::fprintf(stderr, "nixl_read: the bytes did not arrive\n");
    return 1;
  }
  ok(a->releaseXferReq(req), "releaseXferReq");
  ok(a->genNotif(target, "done"), "genNotif");
  int status = 0;
  waitpid(pid, &status, 0);
  a->releasedDlistH(lh);
  a->releasedDlistH(rh);
  a->deregisterMem(reg);
  delete a;
  std::printf(
      "{\"block\":%zu,\"count\":%zu,\"scatter\":%s,\"skipMerge\":%s,\"gbps\":%.3f,\"gbpsMin\":%.3f,\"gbpsMax\":%.3f,"
      "\"postUs\":%.1f}\n",
      block, count, scatter ? "true" : "false", skipMerge ? "true" : "false", median(gbps),
      *std::min_element(gbps.begin(), gbps.end()), *std::max_element(gbps.begin(), gbps.end()), median(postUs));
  return WIFEXITED(status) && WEXITSTATUS(status) == 0 ? 0 : 1;
}
