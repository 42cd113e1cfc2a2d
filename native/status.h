// Status codes shared by both engines. The numeric values are NIXL's own
// nixl_status_t, so an error from either engine carries the number a NIXL
// user already knows, and the JS layer maps them to string codes.
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

inline const char* statusCode(int s) {
  switch (s) {
    case IN_PROG: return "NIXL_IN_PROG";
    case SUCCESS: return "NIXL_SUCCESS";
    case ERR_NOT_POSTED: return "NIXL_ERR_NOT_POSTED";
    case ERR_INVALID_PARAM: return "NIXL_ERR_INVALID_PARAM";
    case ERR_BACKEND: return "NIXL_ERR_BACKEND";
    case ERR_NOT_FOUND: return "NIXL_ERR_NOT_FOUND";
    case ERR_MISMATCH: return "NIXL_ERR_MISMATCH";
    case ERR_NOT_ALLOWED: return "NIXL_ERR_NOT_ALLOWED";
    case ERR_REPOST_ACTIVE: return "NIXL_ERR_REPOST_ACTIVE";
    case ERR_NOT_SUPPORTED: return "NIXL_ERR_NOT_SUPPORTED";
    case ERR_REMOTE_DISCONNECT: return "NIXL_ERR_REMOTE_DISCONNECT";
    case ERR_CANCELED: return "NIXL_ERR_CANCELED";
    case ERR_NO_TELEMETRY: return "NIXL_ERR_NO_TELEMETRY";
    default: return "NIXL_ERR_UNKNOWN";
  }
}

// Thrown by engines; the addon turns it into a JS NixlError with code + status.
struct EngineError : std::runtime_error {
  int status;
  EngineError(int s, const std::string& msg) : std::runtime_error(msg), status(s) {}
};

}  // namespace nixlnode
