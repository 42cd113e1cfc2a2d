// The native baseline for `npm run bench`: the same prepped READs as the
// binding's nixl rows, between two processes, written straight against
// libnixl. Built by bench/native.ts only when an installed NIXL is found.
//
//   nixl_read --block BYTES --count N --reps R [--scatter] [--skip-merge] [--no-progress-thread]
//   nixl_read --serve POOL_BYTES    then lines "BLOCK COUNT REPS SCATTER MERGEOFF", or
//                                   "grid OP BLOCK BATCH ITERS WARMUP" (OP: READ | WRITE)
//
// --scatter reads every other remote block, so no two descriptors are
// contiguous and NIXL cannot merge them; --skip-merge sets skipDescMerge.
// Prints one JSON line per job: medians and ranges of GB/s and of the post
// call. --serve keeps one process pair and its registered memory for many
// jobs, so the bench can alternate it with the binding second by second (the
// same memory, the same moment) instead of comparing runs minutes apart.
// A grid job is one cell of the bench's nixlbench-shaped grid (bench/grid.ts),
// measured the same way: prep (createXferReq) sampled ITERS times, then one
// request posted WARMUP + ITERS times; avg and p99 of prep, post and transfer
// (post return to completion) in us, and GB/s over the timed posts.
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

const char* USAGE =
    "usage: nixl_read --block BYTES --count N --reps R [--scatter] [--skip-merge] [--no-progress-thread]\n"
    "       nixl_read --serve POOL_BYTES  (then one job per stdin line: BLOCK COUNT REPS SCATTER SKIPMERGE)\n";

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
bool progressThread = true;  // --no-progress-thread: as the binding's progressThread: false

nixlAgent* makeAgent(const char* name) {
  auto* a = new nixlAgent(name, nixlAgentConfig(progressThread, false, 0, nixl_thread_sync_t::NIXL_THREAD_SYNC_RW, 1,
                                                progressThread ? 1000 : 0));
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

struct Pair {
  nixlAgent* agent = nullptr;
  std::string target;
  std::vector<char> mem;  // the initiator's side
  nixl_reg_dlist_t reg{DRAM_SEG};
  uintptr_t remoteBase = 0;
  size_t remoteBytes = 0;
  pid_t child = 0;
};

// Forks the target (remoteBytes of registered memory, progressing until the
// initiator's "done" notification) and makes the initiator with localBytes.
Pair connect(size_t localBytes, size_t remoteBytes) {
  int toChild[2], toParent[2];
  if (pipe(toChild) != 0 || pipe(toParent) != 0) std::exit(2);
  pid_t pid = fork();
  if (pid == 0) {
    std::vector<char> mem(remoteBytes, 0x5a);
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
      // NIXL's progress thread serves the READs; this loop only waits for the
      // end, and waking often would take CPU from the copies being measured
      // (the binding's idle peer backs off to 16 ms).
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    t->deregisterMem(reg);
    delete t;
    _exit(0);
  }
  Pair p;
  p.mem.assign(localBytes, 0);
  p.remoteBytes = remoteBytes;
  p.child = pid;
  p.agent = makeAgent("native-initiator");
  p.reg = registerAll(p.agent, p.mem);
  const std::string md = localMD(p.agent);
  std::string tmd = readBlob(toParent[0]);
  p.remoteBase = std::strtoull(readBlob(toParent[0]).c_str(), nullptr, 10);
  writeBlob(toChild[1], md);
  ok(p.agent->loadRemoteMD(tmd, p.target), "loadRemoteMD");
  return p;
}

struct Job {
  size_t block = 64 << 10, count = 1024;
  int reps = 7;
  bool scatter = false, skipMerge = false;
};

// One prepped READ of job.count blocks (every other remote block when
// scattered), a warm-up and job.reps timed posts; prints one JSON line.
bool runJob(Pair& p, const Job& job) {
  const size_t remoteBlocks = job.scatter ? 2 * job.count : job.count;
  if (job.count == 0 || job.block == 0 || job.count * job.block > p.mem.size() ||
      remoteBlocks * job.block > p.remoteBytes || job.reps < 1) {
    std::printf("{\"error\":\"the job does not fit the registered memory\"}\n");
    std::fflush(stdout);
    return false;
  }
  std::memset(p.mem.data(), 0, job.count * job.block);
  nixl_xfer_dlist_t local(DRAM_SEG), remote(DRAM_SEG);
  for (size_t i = 0; i < job.count; i++)
    local.addDesc(nixlBasicDesc(reinterpret_cast<uintptr_t>(p.mem.data()) + i * job.block, job.block, 0));
  for (size_t j = 0; j < remoteBlocks; j++) remote.addDesc(nixlBasicDesc(p.remoteBase + j * job.block, job.block, 0));
  nixlDlistH *lh = nullptr, *rh = nullptr;
  ok(p.agent->prepXferDlist(NIXL_INIT_AGENT, local, lh), "prepXferDlist (local)");
  ok(p.agent->prepXferDlist(p.target, remote, rh), "prepXferDlist (remote)");
  std::vector<int> li(job.count), ri(job.count);
  for (size_t i = 0; i < job.count; i++) {
    li[i] = static_cast<int>(i);
    ri[i] = static_cast<int>(job.scatter ? 2 * i : i);
  }
  nixl_opt_args_t opts;
  opts.skipDescMerge = job.skipMerge;
  nixlXferReqH* req = nullptr;
  ok(p.agent->makeXferReq(NIXL_READ, lh, li, rh, ri, req, &opts), "makeXferReq");

  std::vector<double> gbps, postUs;
  for (int r = -1; r < job.reps; r++) {  // r = -1: warm-up
    auto t0 = Clock::now();
    nixl_status_t s = p.agent->postXferReq(req);
    auto t1 = Clock::now();
    ok(s, "postXferReq");
    while (s == NIXL_IN_PROG) s = p.agent->getXferStatus(req);
    ok(s, "getXferStatus");
    auto t2 = Clock::now();
    if (r < 0) continue;
    gbps.push_back(static_cast<double>(job.count * job.block) /
                   std::chrono::duration<double, std::nano>(t2 - t0).count());
    postUs.push_back(std::chrono::duration<double, std::micro>(t1 - t0).count());
  }
  ok(p.agent->releaseXferReq(req), "releaseXferReq");
  p.agent->releasedDlistH(lh);
  p.agent->releasedDlistH(rh);
  if (p.mem[0] != 0x5a || p.mem[job.count * job.block - 1] != 0x5a) {
    std::fprintf(stderr, "nixl_read: the bytes did not arrive\n");
    std::exit(1);
  }
  std::printf(
      "{\"block\":%zu,\"count\":%zu,\"scatter\":%s,\"skipMerge\":%s,\"gbps\":%.3f,\"gbpsMin\":%.3f,\"gbpsMax\":%.3f,"
      "\"postUs\":%.1f}\n",
      job.block, job.count, job.scatter ? "true" : "false", job.skipMerge ? "true" : "false", median(gbps),
      *std::min_element(gbps.begin(), gbps.end()), *std::max_element(gbps.begin(), gbps.end()), median(postUs));
  std::fflush(stdout);
  return true;
}

struct Dist {
  double avg, p99;
};

Dist dist(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  double sum = 0;
  for (double x : v) sum += x;
  size_t i = std::min(v.size() - 1, static_cast<size_t>(0.99 * static_cast<double>(v.size())));
  return Dist{sum / static_cast<double>(v.size()), v[i]};
}

double usBetween(Clock::time_point a, Clock::time_point b) {
  return std::chrono::duration<double, std::micro>(b - a).count();
}

bool runGridJob(Pair& p, nixl_xfer_op_t op, size_t block, size_t batch, int iters, int warmup) {
  if (block == 0 || batch == 0 || iters < 1 || warmup < 0 || block * batch > p.mem.size() ||
      block * batch > p.remoteBytes) {
    std::printf("{\"error\":\"the grid job does not fit the registered memory\"}\n");
    std::fflush(stdout);
    return false;
  }
  nixl_xfer_dlist_t local(DRAM_SEG), remote(DRAM_SEG);
  for (size_t j = 0; j < batch; j++) {
    local.addDesc(nixlBasicDesc(reinterpret_cast<uintptr_t>(p.mem.data()) + j * block, block, 0));
    remote.addDesc(nixlBasicDesc(p.remoteBase + j * block, block, 0));
  }
  std::vector<double> prep, post, xfer, total;
  for (int i = 0; i < iters; i++) {
    nixlXferReqH* r = nullptr;
    auto t0 = Clock::now();
    ok(p.agent->createXferReq(op, local, remote, p.target, r), "createXferReq");
    prep.push_back(usBetween(t0, Clock::now()));
    ok(p.agent->releaseXferReq(r), "releaseXferReq");
  }
  nixlXferReqH* req = nullptr;
  ok(p.agent->createXferReq(op, local, remote, p.target, req), "createXferReq");
  double totalUs = 0;
  for (int i = -warmup; i < iters; i++) {
    auto t0 = Clock::now();
    nixl_status_t s = p.agent->postXferReq(req);
    auto t1 = Clock::now();
    ok(s, "postXferReq");
    while (s == NIXL_IN_PROG) s = p.agent->getXferStatus(req);
    ok(s, "getXferStatus");
    auto t2 = Clock::now();
    if (i < 0) continue;
    post.push_back(usBetween(t0, t1));
    xfer.push_back(usBetween(t1, t2));
    total.push_back(usBetween(t0, t2));
    totalUs += total.back();
  }
  ok(p.agent->releaseXferReq(req), "releaseXferReq");
  Dist a = dist(prep), b = dist(post), c = dist(xfer);
  std::printf(
      "{\"grid\":true,\"op\":\"%s\",\"block\":%zu,\"batch\":%zu,\"gbps\":%.4f,"
      "\"prepUs\":{\"avg\":%.2f,\"p99\":%.2f},\"postUs\":{\"avg\":%.2f,\"p99\":%.2f},"
      "\"xferUs\":{\"avg\":%.2f,\"p99\":%.2f},\"medianUs\":%.3f}\n",
      op == NIXL_READ ? "READ" : "WRITE", block, batch, static_cast<double>(block * batch) * iters / (totalUs * 1000.0),
      a.avg, a.p99, b.avg, b.p99, c.avg, c.p99, median(total));
  std::fflush(stdout);
  return true;
}

}  // namespace

int main(int argc, char** argv) {
  Job job;
  size_t pool = 0;
  bool serve = false;
  for (int i = 1; i < argc; i++) {
    std::string a = argv[i];
    if (a == "--block" && i + 1 < argc)
      job.block = std::strtoull(argv[++i], nullptr, 10);
    else if (a == "--count" && i + 1 < argc)
      job.count = std::strtoull(argv[++i], nullptr, 10);
    else if (a == "--reps" && i + 1 < argc)
      job.reps = std::atoi(argv[++i]);
    else if (a == "--scatter")
      job.scatter = true;
    else if (a == "--skip-merge")
      job.skipMerge = true;
    else if (a == "--no-progress-thread")
      progressThread = false;
    else if (a == "--serve" && i + 1 < argc) {
      serve = true;
      pool = std::strtoull(argv[++i], nullptr, 10);
    } else {
      std::fprintf(stderr, "%s", USAGE);
      return 2;
    }
  }
  if (!serve) pool = job.count * job.block;
  // The target always holds twice the pool: a scattered job reads every other block.
  Pair p = connect(pool, 2 * pool);
  bool good = true;
  if (serve) {
    std::printf("{\"ready\":true}\n");
    std::fflush(stdout);
    char line[256];
    while (std::fgets(line, sizeof line, stdin)) {
      unsigned long long b = 0, c = 0;
      int r = 0, s = 0, m = 0;
      char op[8] = {0};
      if (std::strncmp(line, "grid ", 5) == 0) {
        if (std::sscanf(line + 5, "%7s %llu %llu %d %d", op, &b, &c, &r, &s) != 5 ||
            (std::strcmp(op, "READ") != 0 && std::strcmp(op, "WRITE") != 0)) {
          std::printf("{\"error\":\"expected: grid READ|WRITE BLOCK BATCH ITERS WARMUP\"}\n");
          std::fflush(stdout);
          continue;
        }
        runGridJob(p, std::strcmp(op, "READ") == 0 ? NIXL_READ : NIXL_WRITE, b, c, r, s);
        continue;
      }
      if (std::sscanf(line, "%llu %llu %d %d %d", &b, &c, &r, &s, &m) != 5) {
        std::printf("{\"error\":\"expected: BLOCK COUNT REPS SCATTER(0|1) SKIPMERGE(0|1)\"}\n");
        std::fflush(stdout);
        continue;
      }
      runJob(p, Job{b, c, r, s != 0, m != 0});
    }
  } else {
    good = runJob(p, job);
  }
  ok(p.agent->genNotif(p.target, "done"), "genNotif");
  // Without a progress thread nothing sends the notification but this
  // agent's own progress (getNotifs drives it): keep progressing until the
  // target has read it and exited.
  int status = 0;
  while (waitpid(p.child, &status, WNOHANG) == 0) {
    nixl_notifs_t ignored;
    p.agent->getNotifs(ignored);
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  p.agent->deregisterMem(p.reg);
  delete p.agent;
  return good && WIFEXITED(status) && WEXITSTATUS(status) == 0 ? 0 : 1;
}
