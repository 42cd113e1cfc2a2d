// The N-API surface: a flat NativeAgent class over the Engine interface, plus
// allocate/addressOf helpers. lib/native.ts declares what this exports; the
// typed API (lib/agent.ts) builds on it.
//
// Completions: engine threads call onComplete/onNotif; the first event into an
// empty batch signals the ThreadSafeFunction once, and the JS callback gets
// the whole batch as a Uint32Array. The TSFN is Ref'd only while transfers are
// in flight (or someone waits for notifications), so an idle agent never keeps
// the process alive.
#include <napi.h>

#include <atomic>
#include <mutex>
#include <unordered_map>
#include <vector>

#include "engine.h"
#include "loopback/shm.h"

namespace nixlnode {
namespace {

struct AddonData {
  Napi::FunctionReference errorClass;  // NixlError, handed over by lib/errors.ts
};

Napi::Error makeError(Napi::Env env, int status, const std::string& msg) {
  auto* data = env.GetInstanceData<AddonData>();
  if (data && !data->errorClass.IsEmpty()) {
    Napi::Object e = data->errorClass.New({Napi::String::New(env, msg), Napi::String::New(env, statusCode(status)),
                                           Napi::Number::New(env, status)});
    return Napi::Error(env, e);
  }
  Napi::Error e = Napi::Error::New(env, msg);
  e.Set("code", Napi::String::New(env, statusCode(status)));
  e.Set("status", Napi::Number::New(env, status));
  return e;
}

[[noreturn]] void fail(Napi::Env env, int status, const std::string& msg) { throw makeError(env, status, msg); }

// Runs f, turning engine errors into NixlError.
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

std::vector<Desc> descsArg(Napi::Env env, const Napi::Value& v, const char* what) {
  if (!v.IsTypedArray() || v.As<Napi::TypedArray>().TypedArrayType() != napi_biguint64_array)
    fail(env, ERR_INVALID_PARAM, std::string(what) + ": descriptors must be a BigUint64Array of [addr, len, devId] triples");
  auto a = v.As<Napi::BigUint64Array>();
  if (a.ElementLength() % 3 != 0)
    fail(env, ERR_INVALID_PARAM, std::string(what) + ": descriptor array length must be a multiple of 3");
  std::vector<Desc> out(a.ElementLength() / 3);
  const uint64_t* p = a.Data();
  for (size_t i = 0; i < out.size(); ++i) {
    out[i] = Desc{p[3 * i], p[3 * i + 1], p[3 * i + 2]};
    if (descWraps(out[i].addr, out[i].len))
      fail(env, ERR_INVALID_PARAM, std::string(what) + ": descriptor " + std::to_string(i) +
                                       " wraps past the end of the address space (addr + len >= 2^64)");
  }
  return out;
}

MemType memTypeArg(Napi::Env env, const Napi::Value& v) {
  if (!v.IsNumber()) fail(env, ERR_INVALID_PARAM, "memory type must be a number");
  int t = v.As<Napi::Number>().Int32Value();
  if (t < 0 || t > static_cast<int>(MemType::FILE)) fail(env, ERR_INVALID_PARAM, "unknown memory type " + std::to_string(t));
  return static_cast<MemType>(t);
}

std::string stringArg(Napi::Env env, const Napi::Value& v, const char* what) {
  if (!v.IsString()) fail(env, ERR_INVALID_PARAM, std::string(what) + " must be a string");
  return v.As<Napi::String>().Utf8Value();
}

uint32_t handleArg(Napi::Env env, const Napi::Value& v) {
  if (!v.IsNumber()) fail(env, ERR_INVALID_PARAM, "handle must be a number");
  double d = v.As<Napi::Number>().DoubleValue();
  if (d < 1 || d > 4294967295.0 || d != static_cast<double>(static_cast<uint32_t>(d)))
    fail(env, ERR_NOT_FOUND, "invalid handle");
  return static_cast<uint32_t>(d);
}

std::vector<std::string> stringsArg(Napi::Env env, const Napi::Value& v, const char* what) {
  std::vector<std::string> out;
  if (v.IsUndefined() || v.IsNull()) return out;
  if (!v.IsArray()) fail(env, ERR_INVALID_PARAM, std::string(what) + " must be an array of strings");
  auto a = v.As<Napi::Array>();
  for (uint32_t i = 0; i < a.Length(); ++i) out.push_back(stringArg(env, a.Get(i), what));
  return out;
}

// Notification message: undefined/null = none; Buffer / typed array = bytes.
bool blobArg(Napi::Env env, const Napi::Value& v, std::string* out) {
  if (v.IsUndefined() || v.IsNull()) return false;
  if (v.IsTypedArray()) {
    auto t = v.As<Napi::TypedArray>();
    auto ab = t.ArrayBuffer();
    out->assign(static_cast<const char*>(ab.Data()) + t.ByteOffset(), t.ByteLength());
    return true;
  }
  if (v.IsString()) {
    *out = v.As<Napi::String>().Utf8Value();
    return true;
  }
  fail(env, ERR_INVALID_PARAM, "message must be a Buffer, Uint8Array or string");
}

const char* memTypeName(MemType t) {
  switch (t) {
    case MemType::DRAM: return "DRAM";
    case MemType::VRAM: return "VRAM";
    case MemType::BLK: return "BLK";
    case MemType::OBJ: return "OBJ";
    case MemType::FILE: return "FILE";
  }
  return "?";
}

class NativeAgent : public Napi::ObjectWrap<NativeAgent>, public CompletionSink {
  struct TsfnCtx {};

 public:
  static Napi::Function Init(Napi::Env env) {
    return DefineClass(env, "NativeAgent",
                       {
                           InstanceAccessor<&NativeAgent::EngineKind>("engine"),
                           InstanceMethod<&NativeAgent::GetPluginList>("getPluginList"),
                           InstanceMethod<&NativeAgent::GetPluginParams>("getPluginParams"),
                           InstanceMethod<&NativeAgent::CreateBackend>("createBackend"),
                           InstanceMethod<&NativeAgent::GetBackends>("getBackends"),
                           InstanceMethod<&NativeAgent::RegisterMem>("registerMem"),
                           InstanceMethod<&NativeAgent::DeregisterMem>("deregisterMem"),
                           InstanceMethod<&NativeAgent::GetLocalMD>("getLocalMD"),
                           InstanceMethod<&NativeAgent::LoadRemoteMD>("loadRemoteMD"),
                           InstanceMethod<&NativeAgent::GetLocalPartialMD>("getLocalPartialMD"),
                           InstanceMethod<&NativeAgent::SendLocalMD>("sendLocalMD"),
                           InstanceMethod<&NativeAgent::SendLocalPartialMD>("sendLocalPartialMD"),
                           InstanceMethod<&NativeAgent::FetchRemoteMD>("fetchRemoteMD"),
                           InstanceMethod<&NativeAgent::InvalidateLocalMD>("invalidateLocalMD"),
                           InstanceMethod<&NativeAgent::CheckRemoteMD>("checkRemoteMD"),
                           InstanceMethod<&NativeAgent::MakeConnection>("makeConnection"),
                           InstanceMethod<&NativeAgent::QueryMem>("queryMem"),
                           InstanceMethod<&NativeAgent::EstimateXferCost>("estimateXferCost"),
                           InstanceMethod<&NativeAgent::InvalidateRemoteMD>("invalidateRemoteMD"),
                           InstanceMethod<&NativeAgent::PrepXferDlist>("prepXferDlist"),
                           InstanceMethod<&NativeAgent::ReleaseDlist>("releaseDlist"),
                           InstanceMethod<&NativeAgent::MakeXferReq>("makeXferReq"),
                           InstanceMethod<&NativeAgent::CreateXferReq>("createXferReq"),
                           InstanceMethod<&NativeAgent::PostXferReq>("postXferReq"),
                           InstanceMethod<&NativeAgent::GetXferStatus>("getXferStatus"),
                           InstanceMethod<&NativeAgent::ReleaseXferReq>("releaseXferReq"),
                           InstanceMethod<&NativeAgent::GetXferTelemetry>("getXferTelemetry"),
                           InstanceMethod<&NativeAgent::GenNotif>("genNotif"),
                           InstanceMethod<&NativeAgent::GetNotifs>("getNotifs"),
                           InstanceMethod<&NativeAgent::WatchNotifs>("watchNotifs"),
                           InstanceMethod<&NativeAgent::Close>("close"),
                       });
  }

  // new NativeAgent(name, { engine, backends, progressThread, captureTelemetry, ... }, onEvents)
  NativeAgent(const Napi::CallbackInfo& info) : Napi::ObjectWrap<NativeAgent>(info) {
    Napi::Env env = info.Env();
    guard(env, [&] {
      std::string name = stringArg(env, info[0], "agent name");
      if (!info[1].IsObject() || !info[2].IsFunction())
        fail(env, ERR_INVALID_PARAM, "NativeAgent(name, options, onEvents)");
      auto o = info[1].As<Napi::Object>();
      std::string kind = o.Has("engine") ? stringArg(env, o.Get("engine"), "engine") : "loopback";
      EngineConfig cfg;
      cfg.backends = stringsArg(env, o.Get("backends"), "backends");
      if (o.Get("progressThread").IsBoolean()) cfg.progressThread = o.Get("progressThread").As<Napi::Boolean>();
      if (o.Get("captureTelemetry").IsBoolean()) cfg.captureTelemetry = o.Get("captureTelemetry").As<Napi::Boolean>();
      if (o.Get("progressDelayUs").IsNumber()) cfg.progressDelayUs = o.Get("progressDelayUs").As<Napi::Number>().Uint32Value();
      if (o.Get("listenPort").IsNumber()) cfg.listenPort = o.Get("listenPort").As<Napi::Number>().Int32Value();
      if (o.Get("testDelayUs").IsNumber()) cfg.testDelayUs = o.Get("testDelayUs").As<Napi::Number>().Uint32Value();
      if (kind == "loopback") {
        engine_ = makeLoopbackEngine(name, cfg, this);
#ifdef NIXL_NODE_WITH_NIXL
      } else if (kind == "nixl") {
        engine_ = makeNixlEngine(name, cfg, this);
#endif
      } else if (kind == "nixl") {
        fail(env, ERR_NOT_SUPPORTED,
             "engine 'nixl' is not compiled in: NIXL was not found at build time (set NIXL_PREFIX to its install "
             "prefix and rebuild with npm run build)");
      } else {
        fail(env, ERR_INVALID_PARAM, "unknown engine '" + kind + "' (expected 'loopback' or 'nixl')");
      }
      tsfn_ = Tsfn::New(env, info[2].As<Napi::Function>(), "nixl-node completions", 0, 1, &tsfnCtx_);
      tsfn_.Unref(env);
      haveTsfn_ = true;
      napi_add_env_cleanup_hook(env, &NativeAgent::EnvCleanup, this);
      return 0;
    });
  }

  ~NativeAgent() override {
    if (engine_) {
      napi_remove_env_cleanup_hook(Env(), &NativeAgent::EnvCleanup, this);
      Shutdown();
    }
  }

  // Engine threads.
  void onComplete(Handle h) override {
    std::lock_guard<std::mutex> lk(mu_);
    finished_.push_back(h);
    SignalLocked();
  }
  void onNotif() override {
    if (!notifWatch_.load()) return;
    std::lock_guard<std::mutex> lk(mu_);
    notifPending_ = true;
    SignalLocked();
  }

 private:
  void SignalLocked() {
    if (signalled_ || !haveTsfn_) return;
    signalled_ = true;
    tsfn_.NonBlockingCall(this);
  }

  // Main thread: hand the batch to JS in one call.
  static void Deliver(Napi::Env env, Napi::Function fn, TsfnCtx*, NativeAgent* self) {
    if (env == nullptr || self == nullptr) return;
    std::vector<uint32_t> batch;
    bool notif;
    {
      std::lock_guard<std::mutex> lk(self->mu_);
      batch.swap(self->finished_);
      notif = self->notifPending_;
      self->notifPending_ = false;
      self->signalled_ = false;
    }
    self->inflight_ -= std::min<uint32_t>(self->inflight_, static_cast<uint32_t>(batch.size()));
    self->UpdateRef(env);
    if (!self->engine_) return;  // closed meanwhile
    auto arr = Napi::Uint32Array::New(env, batch.size());
    if (!batch.empty()) memcpy(arr.Data(), batch.data(), batch.size() * 4);
    fn.Call({arr, Napi::Boolean::New(env, notif)});
  }

  void UpdateRef(Napi::Env env) {
    if (!haveTsfn_) return;
    bool want = inflight_ > 0 || notifWatch_.load();
    if (want == refd_) return;
    refd_ = want;
    if (want) tsfn_.Ref(env);
    else tsfn_.Unref(env);
  }

  Engine& E(Napi::Env env) {
    if (!engine_) fail(env, ERR_NOT_ALLOWED, "agent is closed");
    return *engine_;
  }

  Napi::Value EngineKind(const Napi::CallbackInfo& info) {
    return Napi::String::New(info.Env(), engine_ ? engine_->kind() : "closed");
  }

  Napi::Value GetPluginList(const Napi::CallbackInfo& info) {
    Napi::Env env = info.Env();
    return guard(env, [&] {
      auto list = E(env).getPluginList();
      auto a = Napi::Array::New(env, list.size());
      for (uint32_t i = 0; i < list.size(); ++i) a.Set(i, list[i]);
      return a;
    });
  }

  Napi::Value GetPluginParams(const Napi::CallbackInfo& info) {
    Napi::Env env = info.Env();
    return guard(env, [&] {
      PluginInfo p = E(env).getPluginParams(stringArg(env, info[0], "plugin"));
      auto params = Napi::Object::New(env);
      for (auto& [k, v] : p.params) params.Set(k, v);
      auto mems = Napi::Array::New(env, p.memTypes.size());
      for (uint32_t i = 0; i < p.memTypes.size(); ++i) mems.Set(i, memTypeName(p.memTypes[i]));
      auto o = Napi::Object::New(env);
      o.Set("params", params);
      o.Set("memTypes", mems);
      return o;
    });
  }

  Napi::Value CreateBackend(const Napi::CallbackInfo& info) {
    Napi::Env env = info.Env();
    return guard(env, [&] {
      Params params;
      if (info[1].IsObject()) {
        auto o = info[1].As<Napi::Object>();
        auto keys = o.GetPropertyNames();
        for (uint32_t i = 0; i < keys.Length(); ++i) {
          std::string k = keys.Get(i).ToString().Utf8Value();
          params[k] = o.Get(k).ToString().Utf8Value();
        }
      }
      E(env).createBackend(stringArg(env, info[0], "plugin"), params);
      return env.Undefined();
    });
  }

  Napi::Value GetBackends(const Napi::CallbackInfo& info) {
    Napi::Env env = info.Env();
    return guard(env, [&] {
      auto list = E(env).getBackends();
      auto a = Napi::Array::New(env, list.size());
      for (uint32_t i = 0; i < list.size(); ++i) a.Set(i, list[i]);
      return a;
    });
  }

  // registerMem(descs, memType, backends, keepAlive[]) -> handle
  Napi::Value RegisterMem(const Napi::CallbackInfo& info) {
    Napi::Env env = info.Env();
    return guard(env, [&] {
      auto descs = descsArg(env, info[0], "registerMemory");
      Handle h = E(env).registerMem(descs, memTypeArg(env, info[1]), stringsArg(env, info[2], "backends"));
      // The registration owns the JS memory it covers: it cannot be collected
      // while an engine may still copy into it.
      auto& keep = keep_[h];
      if (info[3].IsArray()) {
        auto a = info[3].As<Napi::Array>();
        for (uint32_t i = 0; i < a.Length(); ++i) keep.push_back(Napi::Persistent(a.Get(i)));
      }
      return Napi::Number::New(env, h);
    });
  }

  Napi::Value DeregisterMem(const Napi::CallbackInfo& info) {
    Napi::Env env = info.Env();
    return guard(env, [&] {
      Handle h = handleArg(env, info[0]);
      E(env).deregisterMem(h);
      keep_.erase(h);
      return env.Undefined();
    });
  }

  Napi::Value GetLocalMD(const Napi::CallbackInfo& info) {
    Napi::Env env = info.Env();
    return guard(env, [&] {
      std::string md = E(env).getLocalMD();
      return Napi::Buffer<char>::Copy(env, md.data(), md.size());
    });
  }

  Napi::Value LoadRemoteMD(const Napi::CallbackInfo& info) {
    Napi::Env env = info.Env();
    return guard(env, [&] {
      std::string md;
      if (!blobArg(env, info[0], &md) || info[0].IsString()) fail(env, ERR_INVALID_PARAM, "metadata must be a Buffer");
      return Napi::String::New(env, E(env).loadRemoteMD(md));
    });
  }

  static int portArg(const Napi::Value& v) { return v.IsNumber() ? v.As<Napi::Number>().Int32Value() : 0; }
  static std::string ipArg(Napi::Env env, const Napi::Value& v) {
    return v.IsUndefined() || v.IsNull() ? std::string() : stringArg(env, v, "ip");
  }

  // getLocalPartialMD(descs, memType, includeConnInfo, backends) -> Buffer
  Napi::Value GetLocalPartialMD(const Napi::CallbackInfo& info) {
    Napi::Env env = info.Env();
    return guard(env, [&] {
      std::string md = E(env).getLocalPartialMD(descsArg(env, info[0], "getLocalPartialMD"), memTypeArg(env, info[1]),
                                                info[2].ToBoolean().Value(), stringsArg(env, info[3], "backends"));
      return Napi::Buffer<char>::Copy(env, md.data(), md.size());
    });
  }

  Napi::Value SendLocalMD(const Napi::CallbackInfo& info) {
    Napi::Env env = info.Env();
    return guard(env, [&] {
      E(env).sendLocalMD(ipArg(env, info[0]), portArg(info[1]));
      return env.Undefined();
    });
  }

  Napi::Value SendLocalPartialMD(const Napi::CallbackInfo& info) {
    Napi::Env env = info.Env();
    return guard(env, [&] {
      E(env).sendLocalPartialMD(descsArg(env, info[0], "sendLocalPartialMD"), memTypeArg(env, info[1]), ipArg(env, info[2]),
                                portArg(info[3]));
      return env.Undefined();
    });
  }

  Napi::Value FetchRemoteMD(const Napi::CallbackInfo& info) {
    Napi::Env env = info.Env();
    return guard(env, [&] {
      E(env).fetchRemoteMD(stringArg(env, info[0], "agent name"), ipArg(env, info[1]), portArg(info[2]));
      return env.Undefined();
    });
  }

  Napi::Value InvalidateLocalMD(const Napi::CallbackInfo& info) {
    Napi::Env env = info.Env();
    return guard(env, [&] {
      E(env).invalidateLocalMD(ipArg(env, info[0]), portArg(info[1]));
      return env.Undefined();
    });
  }

  // checkRemoteMD(agent, descs, memType) -> boolean
  Napi::Value CheckRemoteMD(const Napi::CallbackInfo& info) {
    Napi::Env env = info.Env();
    return guard(env, [&] {
      return Napi::Boolean::New(env, E(env).checkRemoteMD(stringArg(env, info[0], "agent name"),
                                                          descsArg(env, info[1], "checkRemoteMD"), memTypeArg(env, info[2])));
    });
  }

  Napi::Value MakeConnection(const Napi::CallbackInfo& info) {
    Napi::Env env = info.Env();
    return guard(env, [&] {
      E(env).makeConnection(stringArg(env, info[0], "agent name"));
      return env.Undefined();
    });
  }

  // queryMem(descs, memType, backends) -> Array<Record<string,string> | null>
  Napi::Value QueryMem(const Napi::CallbackInfo& info) {
    Napi::Env env = info.Env();
    return guard(env, [&] {
      auto resp = E(env).queryMem(descsArg(env, info[0], "queryMem"), memTypeArg(env, info[1]), stringsArg(env, info[2], "backends"));
      auto a = Napi::Array::New(env, resp.size());
      for (uint32_t i = 0; i < resp.size(); ++i) {
        if (!resp[i]) {
          a.Set(i, env.Null());
          continue;
        }
        auto o = Napi::Object::New(env);
        for (auto& [k, v] : *resp[i]) o.Set(k, v);
        a.Set(i, o);
      }
      return a;
    });
  }

  Napi::Value EstimateXferCost(const Napi::CallbackInfo& info) {
    Napi::Env env = info.Env();
    return guard(env, [&] {
      auto c = E(env).estimateXferCost(handleArg(env, info[0]));
      auto o = Napi::Object::New(env);
      o.Set("durationUs", Napi::Number::New(env, static_cast<double>(c.durationUs)));
      o.Set("errMarginUs", Napi::Number::New(env, static_cast<double>(c.errMarginUs)));
      o.Set("method", Napi::String::New(env, c.method == 0 ? "ANALYTICAL_BACKEND" : "UNKNOWN"));
      return o;
    });
  }

  Napi::Value InvalidateRemoteMD(const Napi::CallbackInfo& info) {
    Napi::Env env = info.Env();
    return guard(env, [&] {
      E(env).invalidateRemoteMD(stringArg(env, info[0], "agent name"));
      return env.Undefined();
    });
  }

  // prepXferDlist(agent | "", descs, memType, backends) -> handle
  Napi::Value PrepXferDlist(const Napi::CallbackInfo& info) {
    Napi::Env env = info.Env();
    return guard(env, [&] {
      Handle h = E(env).prepXferDlist(stringArg(env, info[0], "agent name"), descsArg(env, info[1], "prepXferDlist"),
                                      memTypeArg(env, info[2]), stringsArg(env, info[3], "backends"));
      return Napi::Number::New(env, h);
    });
  }

  Napi::Value ReleaseDlist(const Napi::CallbackInfo& info) {
    Napi::Env env = info.Env();
    return guard(env, [&] {
      E(env).releaseDlist(handleArg(env, info[0]));
      return env.Undefined();
    });
  }

  static XferOp opArg(Napi::Env env, const Napi::Value& v) {
    std::string s = v.IsString() ? v.As<Napi::String>().Utf8Value() : "";
    if (s == "READ") return XferOp::READ;
    if (s == "WRITE") return XferOp::WRITE;
    fail(env, ERR_INVALID_PARAM, "operation must be 'READ' or 'WRITE'");
  }

  static Napi::Uint32Array indicesArg(Napi::Env env, const Napi::Value& v) {
    if (!v.IsTypedArray() || v.As<Napi::TypedArray>().TypedArrayType() != napi_uint32_array)
      fail(env, ERR_INVALID_PARAM, "indices must be a Uint32Array");
    return v.As<Napi::Uint32Array>();
  }

  // makeXferReq(op, localDlist, localIdx, remoteDlist, remoteIdx, notif?) -> handle
  Napi::Value MakeXferReq(const Napi::CallbackInfo& info) {
    Napi::Env env = info.Env();
    return guard(env, [&] {
      XferOp op = opArg(env, info[0]);
      auto li = indicesArg(env, info[2]);
      auto ri = indicesArg(env, info[4]);
      std::string notif;
      bool has = blobArg(env, info[5], &notif);
      Handle h = E(env).makeXferReq(op, handleArg(env, info[1]), li.Data(), li.ElementLength(),
                                    handleArg(env, info[3]), ri.Data(), ri.ElementLength(), has ? &notif : nullptr);
      return Napi::Number::New(env, h);
    });
  }

  // createXferReq(op, localDescs, localType, remoteDescs, remoteType, agent, notif?) -> handle
  Napi::Value CreateXferReq(const Napi::CallbackInfo& info) {
    Napi::Env env = info.Env();
    return guard(env, [&] {
      XferOp op = opArg(env, info[0]);
      std::string notif;
      bool has = blobArg(env, info[6], &notif);
      Handle h = E(env).createXferReq(op, descsArg(env, info[1], "local"), memTypeArg(env, info[2]),
                                      descsArg(env, info[3], "remote"), memTypeArg(env, info[4]),
                                      stringArg(env, info[5], "remote agent"), has ? &notif : nullptr);
      return Napi::Number::New(env, h);
    });
  }

  Napi::Value PostXferReq(const Napi::CallbackInfo& info) {
    Napi::Env env = info.Env();
    return guard(env, [&] {
      std::string notif;
      bool has = blobArg(env, info[1], &notif);
      int s = E(env).postXferReq(handleArg(env, info[0]), has ? &notif : nullptr);
      if (s == IN_PROG) {
        ++inflight_;
        UpdateRef(env);
      }
      return Napi::Number::New(env, s);
    });
  }

  // -> status number; on error also the message as second element.
  Napi::Value GetXferStatus(const Napi::CallbackInfo& info) {
    Napi::Env env = info.Env();
    return guard(env, [&]() -> Napi::Value {
      std::string err;
      int s = E(env).getXferStatus(handleArg(env, info[0]), &err);
      if (s >= 0) return Napi::Number::New(env, s);
      auto a = Napi::Array::New(env, 2);
      a.Set(0u, Napi::Number::New(env, s));
      a.Set(1u, Napi::String::New(env, err));
      return a;
    });
  }

  Napi::Value ReleaseXferReq(const Napi::CallbackInfo& info) {
    Napi::Env env = info.Env();
    return guard(env, [&] {
      E(env).releaseXferReq(handleArg(env, info[0]));
      return env.Undefined();
    });
  }

  Napi::Value GetXferTelemetry(const Napi::CallbackInfo& info) {
    Napi::Env env = info.Env();
    return guard(env, [&] {
      Telemetry t = E(env).getXferTelemetry(handleArg(env, info[0]));
      auto o = Napi::Object::New(env);
      o.Set("startTimeUs", Napi::Number::New(env, static_cast<double>(t.startTimeUs)));
      o.Set("postDurationUs", Napi::Number::New(env, static_cast<double>(t.postDurationUs)));
      o.Set("xferDurationUs", Napi::Number::New(env, static_cast<double>(t.xferDurationUs)));
      o.Set("totalBytes", Napi::Number::New(env, static_cast<double>(t.totalBytes)));
      o.Set("descCount", Napi::Number::New(env, static_cast<double>(t.descCount)));
      return o;
    });
  }

  Napi::Value GenNotif(const Napi::CallbackInfo& info) {
    Napi::Env env = info.Env();
    return guard(env, [&] {
      std::string msg;
      if (!blobArg(env, info[1], &msg)) fail(env, ERR_INVALID_PARAM, "notification message is required");
      E(env).genNotif(stringArg(env, info[0], "agent name"), msg);
      return env.Undefined();
    });
  }

  // -> [name0, buf0, name1, buf1, ...] in arrival order
  Napi::Value GetNotifs(const Napi::CallbackInfo& info) {
    Napi::Env env = info.Env();
    return guard(env, [&] {
      std::vector<std::pair<std::string, std::string>> list;
      E(env).getNotifs(list);
      auto a = Napi::Array::New(env, list.size() * 2);
      uint32_t i = 0;
      for (auto& [from, msg] : list) {
        a.Set(i++, Napi::String::New(env, from));
        a.Set(i++, Napi::Buffer<char>::Copy(env, msg.data(), msg.size()));
      }
      return a;
    });
  }

  Napi::Value WatchNotifs(const Napi::CallbackInfo& info) {
    Napi::Env env = info.Env();
    notifWatch_ = info[0].ToBoolean().Value();
    UpdateRef(env);
    return env.Undefined();
  }

  Napi::Value Close(const Napi::CallbackInfo& info) {
    if (engine_) {
      napi_remove_env_cleanup_hook(info.Env(), &NativeAgent::EnvCleanup, this);
      Shutdown();
    }
    return info.Env().Undefined();
  }

  void Shutdown() {
    engine_->close();  // joins engine threads: no more onComplete after this
    engine_.reset();
    keep_.clear();
    if (haveTsfn_) {
      {
        std::lock_guard<std::mutex> lk(mu_);
        haveTsfn_ = false;
      }
      tsfn_.Release();
    }
  }

  static void EnvCleanup(void* arg) {
    auto* self = static_cast<NativeAgent*>(arg);
    if (self->engine_) {
      self->engine_->close();
      self->engine_.reset();
    }
  }

  static void DeliverThunk(Napi::Env env, Napi::Function fn, TsfnCtx* ctx, NativeAgent* self) {
    Deliver(env, fn, ctx, self);
  }
  using Tsfn = Napi::TypedThreadSafeFunction<TsfnCtx, NativeAgent, &NativeAgent::DeliverThunk>;

  std::unique_ptr<nixlnode::Engine> engine_;
  Tsfn tsfn_;
  TsfnCtx tsfnCtx_;
  bool haveTsfn_ = false;
  bool refd_ = false;
  uint32_t inflight_ = 0;
  std::atomic<bool> notifWatch_{false};
  std::mutex mu_;
  std::vector<uint32_t> finished_;
  bool notifPending_ = false;
  bool signalled_ = false;
  std::unordered_map<Handle, std::vector<Napi::Reference<Napi::Value>>> keep_;
};

Napi::Value Allocate(const Napi::CallbackInfo& info) {
  Napi::Env env = info.Env();
  return guard(env, [&] {
    if (!info[0].IsNumber()) fail(env, ERR_INVALID_PARAM, "allocate(bytes): bytes must be a number");
    double n = info[0].As<Napi::Number>().DoubleValue();
    if (!(n >= 1) || n > 9007199254740991.0 || n != static_cast<double>(static_cast<uint64_t>(n)))
      fail(env, ERR_INVALID_PARAM, "allocate(bytes): bytes must be a positive integer");
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
      shm::release(p);  // no-op when Node's finalizer already ran
      fail(env, ERR_INVALID_PARAM, "allocate(" + std::to_string(static_cast<uint64_t>(n)) +
                                       "): larger than a Buffer can be in this Node (require('buffer').constants.MAX_LENGTH)");
    }
    return Napi::Value(env, buf);
  });
}

// addressOf(view | ArrayBuffer) -> bigint address of its first byte
Napi::Value AddressOf(const Napi::CallbackInfo& info) {
  Napi::Env env = info.Env();
  return guard(env, [&]() -> Napi::Value {
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
      fail(env, ERR_INVALID_PARAM, "addressOf: expected a Buffer, typed array, DataView or ArrayBuffer");
    }
    return Napi::BigInt::New(env, addr);
  });
}

Napi::Value SetErrorClass(const Napi::CallbackInfo& info) {
  Napi::Env env = info.Env();
  if (!info[0].IsFunction()) fail(env, ERR_INVALID_PARAM, "setErrorClass: expected a constructor");
  env.GetInstanceData<AddonData>()->errorClass = Napi::Persistent(info[0].As<Napi::Function>());
  return env.Undefined();
}

Napi::Object Init(Napi::Env env, Napi::Object exports) {
  auto* data = new AddonData();
  env.SetInstanceData(data);
  exports.Set("NativeAgent", NativeAgent::Init(env));
  exports.Set("allocate", Napi::Function::New(env, Allocate, "allocate"));
  exports.Set("addressOf", Napi::Function::New(env, AddressOf, "addressOf"));
  exports.Set("setErrorClass", Napi::Function::New(env, SetErrorClass, "setErrorClass"));
  auto engines = Napi::Array::New(env);
  engines.Set(0u, "loopback");
#ifdef NIXL_NODE_WITH_NIXL
  engines.Set(1u, "nixl");
#endif
  exports.Set("engines", engines);
  return exports;
}

}  // namespace
}  // namespace nixlnode

static Napi::Object InitModule(Napi::Env env, Napi::Object exports) { return nixlnode::Init(env, exports); }
NODE_API_MODULE(nixl_node, InitModule)
