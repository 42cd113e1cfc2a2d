// Module init: the NativeAgent class, allocate/addressOf, and the hook that
// receives the JS error factory. Every function goes through guarded<>.
#include <napi.h>
#include <nixl_node_status_table.h>

#include <string>

#include "../loopback/shm.h"
#include "agent.h"
#include "errors.h"

namespace nixlnode {
namespace {

Napi::Value Allocate(const Napi::CallbackInfo& info) {
  Napi::Env env = info.Env();
  if (!info[0].IsNumber()) invalidArg(env, "allocate(bytes): bytes must be a number");
  double n = info[0].As<Napi::Number>().DoubleValue();
  if (!(n >= 1) || n > 9007199254740991.0 || n != static_cast<double>(static_cast<uint64_t>(n)))
    invalidArg(env, "allocate(bytes): bytes must be a positive integer");
  // Raw N-API: past Node's Buffer size limit, napi_create_external_buffer
  // fails after Node has already run the finalizer, and node-addon-api's
  // Buffer::New then frees its finalizer data a second time.
  void* p = shm::allocate(static_cast<size_t>(n));
  napi_value buf;
  napi_status st = napi_create_external_buffer(
      env, static_cast<size_t>(n), p, [](napi_env, void* data, void*) { shm::release(data); }, nullptr, &buf);
  if (st != napi_ok) {
    napi_value pending;
    napi_get_and_clear_last_exception(env, &pending);  // Node's RangeError: ours says more
    shm::release(p);                                   // no-op when Node's finalizer already ran
    invalidArg(env, "allocate(" + std::to_string(static_cast<uint64_t>(n)) +
                        "): larger than a Buffer can be in this Node (require('buffer').constants.MAX_LENGTH)");
  }
  return Napi::Value(env, buf);
}

// addressOf(view | ArrayBuffer) -> bigint address of its first byte
Napi::Value AddressOf(const Napi::CallbackInfo& info) {
  Napi::Env env = info.Env();
  uint64_t addr;
  if (info[0].IsTypedArray()) {
    auto t = info[0].As<Napi::TypedArray>();
    addr = reinterpret_cast<uint64_t>(t.ArrayBuffer().Data()) + t.ByteOffset();
  } else if (info[0].IsDataView()) {
    auto t = info[0].As<Napi::DataView>();
    addr = reinterpret_cast<uint64_t>(t.ArrayBuffer().Data()) + t.ByteOffset();
  } else if (info[0].IsArrayBuffer()) {
    addr = reinterpret_cast<uint64_t>(info[0].As<Napi::ArrayBuffer>().Data());
  } else {
    invalidArg(env, "addressOf: expected a Buffer, typed array, DataView or ArrayBuffer");
  }
  return Napi::BigInt::New(env, addr);
}

Napi::Object Init(Napi::Env env, Napi::Object exports) {
  env.SetInstanceData(new AddonData());
  exports.Set("NativeAgent", initNativeAgent(env));
  exports.Set("allocate", Napi::Function::New<guarded<Allocate>>(env, "allocate"));
  exports.Set("addressOf", Napi::Function::New<guarded<AddressOf>>(env, "addressOf"));
  exports.Set("setErrorFactory", Napi::Function::New<guarded<SetErrorFactory>>(env, "setErrorFactory"));
  auto engines = Napi::Array::New(env);
  engines.Set(0u, "loopback");
#ifdef NIXL_NODE_WITH_NIXL
  engines.Set(1u, "nixl");
#endif
  exports.Set("engines", engines);
  // NIXL's status codes as the header this addon was built against names them
  // (scripts/gen-status-table.js), and where that table came from.
  auto codes = Napi::Object::New(env);
#define NIXL_NODE_STATUS_ENTRY(name, value) codes.Set(#name, Napi::Number::New(env, value));
  NIXL_NODE_STATUS_TABLE(NIXL_NODE_STATUS_ENTRY)
#undef NIXL_NODE_STATUS_ENTRY
  exports.Set("statusCodes", codes);
  exports.Set("statusSource", NIXL_NODE_STATUS_SOURCE);
  return exports;
}

}  // namespace
}  // namespace nixlnode

static Napi::Object InitModule(Napi::Env env, Napi::Object exports) { return nixlnode::Init(env, exports); }
NODE_API_MODULE(nixl_node, InitModule)
