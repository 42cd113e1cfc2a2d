// Errors crossing into JS. The JS side owns the error class and the table of
// status names: at load it hands the addon a factory (message, status) ->
// NixlError (lib/native.ts), as better-sqlite3 hands over its error class, so
// C++ only knows NIXL's status numbers (native/status.h).
#pragma once
#include <napi.h>

#include <exception>
#include <new>
#include <string>

#include "../status.h"

namespace nixlnode {

struct AddonData {
  Napi::FunctionReference errorFactory;
};

Napi::Error makeError(Napi::Env env, int status, const std::string& msg);
[[noreturn]] void fail(Napi::Env env, int status, const std::string& msg);
[[noreturn]] inline void invalidArg(Napi::Env env, const std::string& msg) { fail(env, ERR_INVALID_PARAM, msg); }

// setErrorFactory(fn): installs the factory.
Napi::Value SetErrorFactory(const Napi::CallbackInfo& info);

// Runs f, turning every C++ exception into a NixlError: engines throw
// EngineError, the allocator bad_alloc, the readers Napi::Error.
template <class F>
auto guard(Napi::Env env, F&& f) -> decltype(f()) {
  try {
    return f();
  } catch (const EngineError& e) {
    throw makeError(env, e.status, e.what());
  } catch (const Napi::Error&) {
    throw;
  } catch (const std::bad_alloc&) {
    throw makeError(env, ERR_BACKEND, "out of memory");
  } catch (const std::exception& e) {
    throw makeError(env, ERR_UNKNOWN, e.what());
  }
}

// A guarded N-API callback: registered through this template, a function
// cannot forget its guard.
template <Napi::Value (*F)(const Napi::CallbackInfo&)>
Napi::Value guarded(const Napi::CallbackInfo& info) {
  return guard(info.Env(), [&] { return F(info); });
}

}  // namespace nixlnode
