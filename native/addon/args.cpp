#include "args.h"

#include <cmath>

#include "errors.h"

namespace nixlnode::args {
namespace {

// One napi_typeof (IsUndefined and IsNull are one each): optional arguments
// are read on every post.
bool absent(const Napi::Value& v) {
  napi_valuetype t = v.Type();
  return t == napi_undefined || t == napi_null;
}

[[noreturn]] void wrongType(Napi::Env env, const char* what, const char* expected) {
  invalidArg(env, std::string(what) + " must be " + expected);
}

bool isInteger(const Napi::Value& v, double lo, double hi) {
  if (!v.IsNumber()) return false;
  double d = v.As<Napi::Number>().DoubleValue();
  return std::isfinite(d) && d == std::floor(d) && d >= lo && d <= hi;
}

}  // namespace

std::vector<Desc> descs(Napi::Env env, const Napi::Value& v, const char* what) {
  if (!v.IsTypedArray() || v.As<Napi::TypedArray>().TypedArrayType() != napi_biguint64_array)
    wrongType(env, what, "a BigUint64Array of [addr, len, devId] triples");
  auto a = v.As<Napi::BigUint64Array>();
  if (a.ElementLength() % 3 != 0)
    invalidArg(env, std::string(what) + ": descriptor array length must be a multiple of 3");
  std::vector<Desc> out(a.ElementLength() / 3);
  const uint64_t* p = a.Data();
  for (size_t i = 0; i < out.size(); ++i) {
    out[i] = Desc{p[3 * i], p[3 * i + 1], p[3 * i + 2]};
    if (descWraps(out[i].addr, out[i].len))
      invalidArg(env, std::string(what) + ": descriptor " + std::to_string(i) +
                          " wraps past the end of the address space (addr + len >= 2^64)");
  }
  return out;
}

MemType memType(Napi::Env env, const Napi::Value& v) {
  if (!isInteger(v, 0, static_cast<double>(MemType::FILE)))
    wrongType(env, "memory type", "an integer 0-4 (DRAM..FILE)");
  return static_cast<MemType>(v.As<Napi::Number>().Int32Value());
}

std::string string(Napi::Env env, const Napi::Value& v, const char* what) {
  if (!v.IsString()) wrongType(env, what, "a string");
  return v.As<Napi::String>().Utf8Value();
}

bool boolean(Napi::Env env, const Napi::Value& v, const char* what) {
  if (!v.IsBoolean()) wrongType(env, what, "a boolean");
  return v.As<Napi::Boolean>().Value();
}

// One N-API call (a handle is read on every post, a layer-wise sender's
// included): napi_get_value_double answers "not a number" itself.
Handle handle(Napi::Env env, const Napi::Value& v, const char* what) {
  double d;
  if (napi_get_value_double(env, v, &d) != napi_ok) wrongType(env, what, "a handle number");
  if (!(std::isfinite(d) && d == std::floor(d) && d >= 1 && d <= static_cast<double>(kMaxHandle)))
    fail(env, ERR_NOT_FOUND, std::string(what) + ": no such handle");
  return static_cast<Handle>(d);
}

XferOp op(Napi::Env env, const Napi::Value& v) {
  std::string s = v.IsString() ? v.As<Napi::String>().Utf8Value() : "";
  if (s == "READ") return XferOp::READ;
  if (s == "WRITE") return XferOp::WRITE;
  wrongType(env, "operation", "'READ' or 'WRITE'");
}

Napi::Uint32Array indices(Napi::Env env, const Napi::Value& v, const char* what) {
  if (!v.IsTypedArray() || v.As<Napi::TypedArray>().TypedArrayType() != napi_uint32_array)
    wrongType(env, what, "a Uint32Array");
  return v.As<Napi::Uint32Array>();
}

std::vector<std::string> optStrings(Napi::Env env, const Napi::Value& v, const char* what) {
  std::vector<std::string> out;
  if (absent(v)) return out;
  if (!v.IsArray()) wrongType(env, what, "an array of strings");
  auto a = v.As<Napi::Array>();
  for (uint32_t i = 0; i < a.Length(); ++i) out.push_back(string(env, a.Get(i), what));
  return out;
}

std::optional<std::string> optBlob(Napi::Env env, const Napi::Value& v, const char* what) {
  napi_valuetype type = v.Type();
  if (type == napi_undefined || type == napi_null) return std::nullopt;
  if (type == napi_string) return v.As<Napi::String>().Utf8Value();
  if (v.IsTypedArray()) {
    auto t = v.As<Napi::TypedArray>();
    return std::string(static_cast<const char*>(t.ArrayBuffer().Data()) + t.ByteOffset(), t.ByteLength());
  }
  wrongType(env, what, "a Buffer, Uint8Array or string");
}

// A boolean answers the first N-API call; only anything else asks more.
std::optional<bool> optBoolean(Napi::Env env, const Napi::Value& v, const char* what) {
  bool b;
  if (napi_get_value_bool(env, v, &b) == napi_ok) return b;
  if (absent(v)) return std::nullopt;
  wrongType(env, what, "a boolean");
}

std::optional<uint32_t> optUint32(Napi::Env env, const Napi::Value& v, const char* what) {
  if (absent(v)) return std::nullopt;
  if (!isInteger(v, 0, 4294967295.0)) wrongType(env, what, "an integer 0..2^32-1");
  return static_cast<uint32_t>(v.As<Napi::Number>().DoubleValue());
}

std::optional<Handle> optHandle(Napi::Env env, const Napi::Value& v, const char* what) {
  if (absent(v)) return std::nullopt;
  if (!isInteger(v, 1, static_cast<double>(kMaxHandle))) wrongType(env, what, "an integer 1..2^53-1");
  return static_cast<Handle>(v.As<Napi::Number>().DoubleValue());
}

std::string optString(Napi::Env env, const Napi::Value& v, const char* what) {
  return absent(v) ? std::string() : string(env, v, what);
}

int optPort(Napi::Env env, const Napi::Value& v, const char* what) {
  if (absent(v)) return 0;
  if (!isInteger(v, 0, 65535)) wrongType(env, what, "a port number 0-65535");
  return v.As<Napi::Number>().Int32Value();
}

Params optParams(Napi::Env env, const Napi::Value& v, const char* what) {
  Params out;
  if (absent(v)) return out;
  if (!v.IsObject() || v.IsArray() || v.IsFunction()) wrongType(env, what, "an object of string values");
  auto o = v.As<Napi::Object>();
  auto keys = o.GetPropertyNames();
  for (uint32_t i = 0; i < keys.Length(); ++i) {
    std::string k = keys.Get(i).As<Napi::String>().Utf8Value();
    Napi::Value x = o.Get(k);
    if (!x.IsString()) invalidArg(env, std::string(what) + "." + k + " must be a string");
    out[k] = x.As<Napi::String>().Utf8Value();
  }
  return out;
}

}  // namespace nixlnode::args
