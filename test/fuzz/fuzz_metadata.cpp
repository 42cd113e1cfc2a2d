// libFuzzer target: the loopback engine's agent metadata decoder, which reads
// bytes that come off a wire (a side channel, another process). Whatever the
// input, decode() returns or throws EngineError; what it accepts re-encodes
// to the same bytes (the format has one encoding per value).
#include <cstdint>
#include <cstdlib>
#include <string>

#include "../../native/loopback/metadata.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  std::string blob(reinterpret_cast<const char*>(data), size);
  nixlnode::loopback::AgentMd md;
  try {
    md = nixlnode::loopback::decode(blob);
  } catch (const nixlnode::EngineError&) {
    return 0;
  }
  if (!nixlnode::loopback::validUtf8(md.name)) abort();
  for (const auto& r : md.regions)
    if (r.len == 0 || nixlnode::descWraps(r.addr, r.len)) abort();
  if (nixlnode::loopback::encode(md) != blob) abort();
  return 0;
}
