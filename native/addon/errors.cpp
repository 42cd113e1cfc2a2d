#include "errors.h"

namespace nixlnode {

Napi::Error makeError(Napi::Env env, int status, const std::string& msg) {
  auto* data = env.GetInstanceData<AddonData>();
  if (data && !data->errorFactory.IsEmpty()) {
    Napi::Value e = data->errorFactory.Call({Napi::String::New(env, msg), Napi::Number::New(env, status)});
    if (e.IsObject()) return Napi::Error(env, e);
  }
  // Before lib/native.ts installed the factory (or if it misbehaved).
  Napi::Error e = Napi::Error::New(env, msg);
  e.Set("status", Napi::Number::New(env, status));
  return e;
}

void fail(Napi::Env env, int status, const std::string& msg) { throw makeError(env, status, msg); }

Napi::Value SetErrorFactory(const Napi::CallbackInfo& info) {
  Napi::Env env = info.Env();
  if (!info[0].IsFunction()) invalidArg(env, "setErrorFactory: expected a function (message, status) -> Error");
  env.GetInstanceData<AddonData>()->errorFactory = Napi::Persistent(info[0].As<Napi::Function>());
  return env.Undefined();
}

}  // namespace nixlnode
