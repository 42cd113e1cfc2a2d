// The loopback engine's agent metadata: what a peer needs to reach this agent's
// registered memory and notification socket from the same host. Binary,
// little-endian, versioned; parsing checks every length (it comes off a wire).
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "../engine.h"

namespace nixlnode::loopback {

struct MdRegion {
  uint64_t addr, len, devId;
  MemType type;
  int32_t shmFd;  // -1: not shared, read with process_vm_readv
  uint64_t shmOffset, shmSize, shmIno;
  uint32_t liveSlot;  // the registration's word in the owner's LiveTable
  uint64_t liveWord;  // its value while the registration lives
};

struct AgentMd {
  bool partial = false;  // only some registrations (getLocalPartialMD)
  bool connInfo = true;  // carries what is needed to reach the agent
  std::string name;
  std::string bootId;  // kernel boot id: same host check
  uint32_t pid;
  uint64_t startTime;  // /proc/<pid>/stat starttime: pid reuse check
  uint64_t token;      // instance id, finds same-process agents
  std::string notifAddr;
  int32_t liveFd = -1;  // the owner's LiveTable memfd (slot 0: the agent itself)
  uint64_t liveIno = 0;
  uint64_t agentWord = 0;  // slot 0's value while the agent is open
  std::vector<MdRegion> regions;
};

std::string encode(const AgentMd& md);
AgentMd decode(const std::string& blob);  // throws EngineError(ERR_INVALID_PARAM / ERR_MISMATCH)
bool looksLikeLoopbackMd(const std::string& blob);
bool validUtf8(const std::string& s);

std::string bootId();
uint64_t processStartTime(uint32_t pid);  // 0 if the process is gone

}  // namespace nixlnode::loopback

namespace nixlnode::loopback {
// Index of the first descriptor not covered by read-write mappings of this
// process (/proc/self/maps, read once), or -1 when all are: registering a
// wild pointer fails cleanly instead of crashing the first copy.
long firstUnmapped(const std::vector<Desc>& descs);
}  // namespace nixlnode::loopback
