// Strict argument readers: a value of the wrong type is NIXL_ERR_INVALID_PARAM
// naming the argument, never a coerced value. "Optional" readers take
// undefined (and null) as absent and nothing else.
#pragma once
#include <napi.h>

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "../engine.h"

namespace nixlnode::args {

// BigUint64Array of [addr, len, devId] triples; refuses wrapping descriptors.
std::vector<Desc> descs(Napi::Env env, const Napi::Value& v, const char* what);
MemType memType(Napi::Env env, const Napi::Value& v);
std::string string(Napi::Env env, const Napi::Value& v, const char* what);
bool boolean(Napi::Env env, const Napi::Value& v, const char* what);
// A handle from this agent: an integer 1..2^53-1 (NIXL_ERR_NOT_FOUND otherwise).
Handle handle(Napi::Env env, const Napi::Value& v, const char* what);
XferOp op(Napi::Env env, const Napi::Value& v);
Napi::Uint32Array indices(Napi::Env env, const Napi::Value& v, const char* what);

std::vector<std::string> optStrings(Napi::Env env, const Napi::Value& v, const char* what);
// Bytes of a Buffer / typed array, or a string's UTF-8; nullopt when absent.
std::optional<std::string> optBlob(Napi::Env env, const Napi::Value& v, const char* what);
std::optional<bool> optBoolean(Napi::Env env, const Napi::Value& v, const char* what);
std::optional<uint32_t> optUint32(Napi::Env env, const Napi::Value& v, const char* what);
// An integer 1..2^53-1, as a handle; nullopt when absent.
std::optional<Handle> optHandle(Napi::Env env, const Napi::Value& v, const char* what);
std::string optString(Napi::Env env, const Napi::Value& v, const char* what);  // "" when absent
int optPort(Napi::Env env, const Napi::Value& v, const char* what);            // 0 when absent
// A plain object whose values are all strings; {} when absent.
Params optParams(Napi::Env env, const Napi::Value& v, const char* what);

}  // namespace nixlnode::args
