#include "metadata.h"

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <sstream>

namespace nixlnode::loopback {
namespace {

constexpr char kMagic[8] = {'N', 'X', 'N', 'L', 'B', 'K', 'M', 'D'};
constexpr uint32_t kVersion = 3;  // 2: registration liveness (LiveTable); 3: a slot per range, with the range
constexpr uint32_t kMaxRegions = 1u << 20;

struct Writer {
  std::string out;
  void u8(uint8_t v) { out.push_back(static_cast<char>(v)); }
  void u32(uint32_t v) { out.append(reinterpret_cast<const char*>(&v), 4); }
  void u64(uint64_t v) { out.append(reinterpret_cast<const char*>(&v), 8); }
  void str(const std::string& s) {
    u32(static_cast<uint32_t>(s.size()));
    out.append(s);
  }
};

struct Reader {
  const std::string& in;
  size_t pos = 0;
  void need(size_t n) {
    if (in.size() - pos < n) throw EngineError(ERR_INVALID_PARAM, "malformed loopback agent metadata (truncated)");
  }
  uint8_t u8() {
    need(1);
    return static_cast<uint8_t>(in[pos++]);
  }
  uint32_t u32() {
    need(4);
    uint32_t v;
    memcpy(&v, in.data() + pos, 4);
    pos += 4;
    return v;
  }
  uint64_t u64() {
    need(8);
    uint64_t v;
    memcpy(&v, in.data() + pos, 8);
    pos += 8;
    return v;
  }
  std::string str(size_t max) {
    uint32_t n = u32();
    if (n > max) throw EngineError(ERR_INVALID_PARAM, "malformed loopback agent metadata (string too long)");
    need(n);
    std::string s = in.substr(pos, n);
    pos += n;
    return s;
  }
};

}  // namespace

bool validUtf8(const std::string& s) {
  const auto* p = reinterpret_cast<const unsigned char*>(s.data());
  size_t i = 0, n = s.size();
  while (i < n) {
    unsigned c = p[i];
    size_t len;
    uint32_t cp;
    if (c < 0x80) {
      ++i;
      continue;
    }
    if (c >= 0xc2 && c <= 0xdf) {
      len = 2;
      cp = c & 0x1f;
    } else if (c >= 0xe0 && c <= 0xef) {
      len = 3;
      cp = c & 0x0f;
    } else if (c >= 0xf0 && c <= 0xf4) {
      len = 4;
      cp = c & 0x07;
    } else
      return false;
    if (n - i < len) return false;
    for (size_t k = 1; k < len; ++k) {
      if ((p[i + k] & 0xc0) != 0x80) return false;
      cp = cp << 6 | (p[i + k] & 0x3f);
    }
    // Overlong forms, UTF-16 surrogates and code points past U+10FFFF.
    if ((len == 3 && cp < 0x800) || (len == 4 && (cp < 0x10000 || cp > 0x10ffff)) || (cp >= 0xd800 && cp <= 0xdfff))
      return false;
    i += len;
  }
  return true;
}

bool looksLikeLoopbackMd(const std::string& blob) {
  return blob.size() >= sizeof kMagic && memcmp(blob.data(), kMagic, sizeof kMagic) == 0;
}

std::string encode(const AgentMd& md) {
  Writer w;
  w.out.append(kMagic, sizeof kMagic);
  w.u32(kVersion);
  w.u8(static_cast<uint8_t>((md.partial ? 1 : 0) | (md.connInfo ? 2 : 0)));
  w.str(md.name);
  w.str(md.bootId);
  w.u32(md.pid);
  w.u64(md.startTime);
  w.u64(md.token);
  w.str(md.notifAddr);
  w.u32(static_cast<uint32_t>(md.liveFd));
  w.u64(md.liveIno);
  w.u64(md.agentWord);
  w.u32(static_cast<uint32_t>(md.regions.size()));
  for (const auto& r : md.regions) {
    w.u64(r.addr);
    w.u64(r.len);
    w.u64(r.devId);
    w.u8(static_cast<uint8_t>(r.type));
    w.u32(static_cast<uint32_t>(r.shmFd));
    w.u64(r.shmOffset);
    w.u64(r.shmSize);
    w.u64(r.shmIno);
    w.u32(r.liveSlot);
    w.u64(r.liveWord);
  }
  return w.out;
}

AgentMd decode(const std::string& blob) {
  if (!looksLikeLoopbackMd(blob))
    throw EngineError(ERR_INVALID_PARAM, "not loopback-engine metadata (from a NIXL engine agent, or corrupt?)");
  Reader r{blob, sizeof kMagic};
  uint32_t version = r.u32();
  if (version != kVersion)
    throw EngineError(ERR_MISMATCH, "loopback metadata version " + std::to_string(version) +
                                        " is not supported (expected " + std::to_string(kVersion) + ")");
  AgentMd md;
  uint8_t flags = r.u8();
  if (flags & ~3u) throw EngineError(ERR_INVALID_PARAM, "malformed loopback agent metadata (unknown flags)");
  md.partial = flags & 1;
  md.connInfo = flags & 2;
  md.name = r.str(4096);
  if (md.name.empty()) throw EngineError(ERR_INVALID_PARAM, "malformed loopback agent metadata (empty name)");
  // Names reach JS as strings: bytes that are not UTF-8 would come back as
  // U+FFFD, and the agent could never be addressed or removed by name.
  if (!validUtf8(md.name))
    throw EngineError(ERR_INVALID_PARAM, "malformed loopback agent metadata (name is not UTF-8)");
  md.bootId = r.str(256);
  md.pid = r.u32();
  md.startTime = r.u64();
  md.token = r.u64();
  md.notifAddr = r.str(256);
  md.liveFd = static_cast<int32_t>(r.u32());
  md.liveIno = r.u64();
  md.agentWord = r.u64();
  uint32_t n = r.u32();
  if (n > kMaxRegions) throw EngineError(ERR_INVALID_PARAM, "malformed loopback agent metadata (region count)");
  md.regions.reserve(n);
  for (uint32_t i = 0; i < n; ++i) {
    MdRegion g{};
    g.addr = r.u64();
    g.len = r.u64();
    g.devId = r.u64();
    uint8_t t = r.u8();
    if (t > static_cast<uint8_t>(MemType::FILE))
      throw EngineError(ERR_INVALID_PARAM, "malformed loopback agent metadata (memory type)");
    g.type = static_cast<MemType>(t);
    g.shmFd = static_cast<int32_t>(r.u32());
    g.shmOffset = r.u64();
    g.shmSize = r.u64();
    g.shmIno = r.u64();
    g.liveSlot = r.u32();
    g.liveWord = r.u64();
    if (g.len == 0 || g.addr + g.len < g.addr)
      throw EngineError(ERR_INVALID_PARAM, "malformed loopback agent metadata (region bounds)");
    md.regions.push_back(g);
  }
  if (r.pos != blob.size()) throw EngineError(ERR_INVALID_PARAM, "malformed loopback agent metadata (trailing bytes)");
  return md;
}

std::string bootId() {
  std::ifstream f("/proc/sys/kernel/random/boot_id");
  std::string s;
  std::getline(f, s);
  return s;
}

uint64_t processStartTime(uint32_t pid) {
  std::ifstream f("/proc/" + std::to_string(pid) + "/stat");
  std::string line;
  if (!std::getline(f, line)) return 0;
  // Field 2 (comm) may hold spaces and parens: skip to the last ')'.
  auto p = line.rfind(')');
  if (p == std::string::npos) return 0;
  std::istringstream is(line.substr(p + 2));
  std::string field;
  // Fields 3..22; starttime is field 22, the 20th after comm.
  for (int i = 3; i <= 22; ++i) {
    if (!(is >> field)) return 0;
  }
  return std::stoull(field);
}

}  // namespace nixlnode::loopback

namespace nixlnode::loopback {

long firstUnmapped(const std::vector<Desc>& descs) {
  struct Range {
    uint64_t lo, hi;
    bool rw;
  };
  std::vector<Range> maps;
  std::ifstream f("/proc/self/maps");
  std::string line;
  while (std::getline(f, line)) {
    uint64_t lo = 0, hi = 0;
    char perms[5] = {0};
    if (sscanf(line.c_str(), "%lx-%lx %4s", &lo, &hi, perms) == 3)
      maps.push_back({lo, hi, perms[0] == 'r' && perms[1] == 'w'});
  }
  // Lines are sorted by address; walk each descriptor across adjacent mappings.
  for (size_t i = 0; i < descs.size(); ++i) {
    uint64_t need = descs[i].addr;
    const uint64_t end = descs[i].addr + descs[i].len;
    auto it = std::upper_bound(maps.begin(), maps.end(), need, [](uint64_t a, const Range& r) { return a < r.hi; });
    for (; need < end && it != maps.end(); ++it) {
      if (it->lo > need || !it->rw) break;
      need = it->hi;
    }
    if (need < end) return static_cast<long>(i);
  }
  return -1;
}

}  // namespace nixlnode::loopback
