// Status codes shared by both engines. The numeric values are NIXL's own
// nixl_status_t, so an error from either engine carries the number a NIXL
// user already knows. Their names (NIXL_ERR_...) live in one place, the JS
// side (lib/errors.ts), which makes the errors (native/addon/errors.h).
#pragma once
#include <cstdint>
#include <stdexcept>
#include <string>

namespace nixlnode {

enum Status : int {
  IN_PROG = 1,
  SUCCESS = 0,
  ERR_NOT_POSTED = -1,
  ERR_INVALID_PARAM = -2,
  ERR_BACKEND = -3,
  ERR_NOT_FOUND = -4,
  ERR_MISMATCH = -5,
  ERR_NOT_ALLOWED = -6,
  ERR_REPOST_ACTIVE = -7,
  ERR_UNKNOWN = -8,
  ERR_NOT_SUPPORTED = -9,
  ERR_REMOTE_DISCONNECT = -10,
  ERR_CANCELED = -11,
  ERR_NO_TELEMETRY = -12,
};

// Thrown by engines; the addon turns it into a JS NixlError with code + status.
struct EngineError : std::runtime_error {
  int status;
  EngineError(int s, const std::string& msg) : std::runtime_error(msg), status(s) {}
};

}  // namespace nixlnode
