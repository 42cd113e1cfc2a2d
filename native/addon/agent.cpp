// NativeAgent: the flat N-API class over one Engine (native/engine.h).
// lib/native.ts declares it; lib/agent/ builds the typed API on it.
//
// Completions: engine threads call onComplete/onNotif; the first event into an
// empty batch signals the ThreadSafeFunction once, and the JS callback gets
// the whole batch as a Float64Array (handles run to 2^53, JS numbers). The
// TSFN is Ref'd only while transfers are in flight (or someone waits for
// notifications), so an idle agent never keeps the process alive.
#include "agent.h"

#include <algorithm>
#include <atomic>
#include <cstring>
#include <mutex>
#include <unordered_map>
#include <vector>

#include "../engine.h"
#include "args.h"
#include "errors.h"
#include "layered.h"

namespace nixlnode {
namespace {

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
  using Callback = Napi::Value (NativeAgent::*)(const Napi::CallbackInfo&);

  // Every method is registered through Guarded: none can skip the guard that
  // turns C++ exceptions into NixlErrors (as zeromq.js registers templated
  // methods).
  template <Callback M>
  Napi::Value Guarded(const Napi::CallbackInfo& info) {
    return guard(info.Env(), [&] { return (this->*M)(info); });
  }
  template <Callback M>
  static PropertyDescriptor Method(const char* name) {
    return InstanceMethod<&NativeAgent::Guarded<M>>(name);
  }

  static Napi::Function Init(Napi::Env env) {
    return DefineClass(env, "NativeAgent",
                       {
                           InstanceAccessor<&NativeAgent::EngineKind>("engine"),
                           Method<&NativeAgent::GetPluginList>("getPluginList"),
                           Method<&NativeAgent::GetPluginParams>("getPluginParams"),
                           Method<&NativeAgent::GetBackendParams>("getBackendParams"),
                           Method<&NativeAgent::QueryXferBackend>("queryXferBackend"),
                           Method<&NativeAgent::CreateBackend>("createBackend"),
                           Method<&NativeAgent::GetBackends>("getBackends"),
                           Method<&NativeAgent::RegisterMem>("registerMem"),
                           Method<&NativeAgent::DeregisterMem>("deregisterMem"),
                           Method<&NativeAgent::GetLocalMD>("getLocalMD"),
                           Method<&NativeAgent::LoadRemoteMD>("loadRemoteMD"),
                           Method<&NativeAgent::GetLocalPartialMD>("getLocalPartialMD"),
                           Method<&NativeAgent::SendLocalMD>("sendLocalMD"),
                           Method<&NativeAgent::SendLocalPartialMD>("sendLocalPartialMD"),
                           Method<&NativeAgent::FetchRemoteMD>("fetchRemoteMD"),
                           Method<&NativeAgent::InvalidateLocalMD>("invalidateLocalMD"),
                           Method<&NativeAgent::CheckRemoteMD>("checkRemoteMD"),
                           Method<&NativeAgent::MakeConnection>("makeConnection"),
                           Method<&NativeAgent::QueryMem>("queryMem"),
                           Method<&NativeAgent::EstimateXferCost>("estimateXferCost"),
                           Method<&NativeAgent::InvalidateRemoteMD>("invalidateRemoteMD"),
                           Method<&NativeAgent::PrepXferDlist>("prepXferDlist"),
                           Method<&NativeAgent::ReleaseDlist>("releaseDlist"),
                           Method<&NativeAgent::MakeXferReq>("makeXferReq"),
                           Method<&NativeAgent::CreateXferReq>("createXferReq"),
                           Method<&NativeAgent::MakeLayeredXferReq>("makeLayeredXferReq"),
                           Method<&NativeAgent::LayerPoster>("layerPoster"),
                           Method<&NativeAgent::XferPoster>("xferPoster"),
                           Method<&NativeAgent::PostXferReq>("postXferReq"),
                           Method<&NativeAgent::GetXferStatus>("getXferStatus"),
                           Method<&NativeAgent::XferBytes>("xferBytes"),
                           Method<&NativeAgent::ReleaseXferReq>("releaseXferReq"),
                           Method<&NativeAgent::GetXferTelemetry>("getXferTelemetry"),
                           Method<&NativeAgent::GenNotif>("genNotif"),
                           Method<&NativeAgent::GetNotifs>("getNotifs"),
                           Method<&NativeAgent::WatchNotifs>("watchNotifs"),
                           Method<&NativeAgent::Close>("close"),
                       });
  }

  // new NativeAgent(name, { engine, backends, progressThread, captureTelemetry, ... }, onEvents)
  NativeAgent(const Napi::CallbackInfo& info) : Napi::ObjectWrap<NativeAgent>(info) {
    Napi::Env env = info.Env();
    guard(env, [&] {
      std::string name = args::string(env, info[0], "agent name");
      if (!info[1].IsObject() || !info[2].IsFunction()) invalidArg(env, "NativeAgent(name, options, onEvents)");
      // Each option read once; absent means the default, a wrong type is an error.
      auto o = info[1].As<Napi::Object>();
      std::string kind = args::optString(env, o.Get("engine"), "options.engine");
      if (kind.empty()) kind = "loopback";
      EngineConfig cfg;
      cfg.backends = args::optStrings(env, o.Get("backends"), "options.backends");
      cfg.progressThread =
          args::optBoolean(env, o.Get("progressThread"), "options.progressThread").value_or(cfg.progressThread);
      cfg.captureTelemetry =
          args::optBoolean(env, o.Get("captureTelemetry"), "options.captureTelemetry").value_or(false);
      cfg.progressDelayUs =
          args::optUint32(env, o.Get("progressDelayUs"), "options.progressDelayUs").value_or(cfg.progressDelayUs);
      cfg.listenPort = args::optPort(env, o.Get("listenPort"), "options.listenPort");
      cfg.testDelayUs = args::optUint32(env, o.Get("testDelayUs"), "options.testDelayUs").value_or(0);
      cfg.inlineMaxBytes = args::optUint32(env, o.Get("inlinePostMaxBytes"), "options.inlinePostMaxBytes").value_or(0);
      cfg.inlineMaxUs = args::optUint32(env, o.Get("inlinePostMaxUs"), "options.inlinePostMaxUs").value_or(0);
      inlineMaxBytes_ = cfg.inlineMaxBytes;
      cfg.testFirstHandle = args::optHandle(env, o.Get("testFirstHandle"), "options.testFirstHandle").value_or(0);
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
        invalidArg(env, "unknown engine '" + kind + "' (expected 'loopback' or 'nixl')");
      }
      tsfn_ = Tsfn::New(env, info[2].As<Napi::Function>(), "nixl-node completions", 0, 1, &tsfnCtx_);
      tsfn_.Unref(env);
      haveTsfn_ = true;
      napi_add_env_cleanup_hook(env, &NativeAgent::EnvCleanup, this);
      return 0;
    });
  }

  ~NativeAgent() override {
    gate_->self = nullptr;  // a poster that outlives its agent refuses to post
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
  // JS thread, inside an engine call: nothing to deliver, one fewer in flight.
  void onCompleteHere(Handle) override {
    if (inflight_ > 0) --inflight_;
    UpdateRef(Env());
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
    std::vector<Handle> batch;
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
    // A layer's request is the addon's own: JS hears of its layered request,
    // once, when the layer ends that request's posting.
    size_t kept = 0;
    for (Handle h : batch) {
      Handle ended = 0;
      bool layer = false;
      try {
        layer = self->layered_.onEngineDone(*self->engine_, h, &ended);
      } catch (const std::exception&) {
        // The layer's engine request cannot say its state (engine closing):
        // its layered request's waiters hear of it from close().
        layer = true;
      }
      if (!layer)
        batch[kept++] = h;
      else if (ended)
        batch[kept++] = ended;
    }
    batch.resize(kept);
    auto arr = Napi::Float64Array::New(env, batch.size());
    double* out = arr.Data();
    for (size_t i = 0; i < batch.size(); ++i) out[i] = static_cast<double>(batch[i]);
    fn.Call({arr, Napi::Boolean::New(env, notif)});
  }

  void UpdateRef(Napi::Env env) {
    if (!haveTsfn_) return;
    bool want = inflight_ > 0 || notifWatch_.load();
    if (want == refd_) return;
    refd_ = want;
    if (want)
      tsfn_.Ref(env);
    else
      tsfn_.Unref(env);
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
    auto list = E(env).getPluginList();
    auto a = Napi::Array::New(env, list.size());
    for (uint32_t i = 0; i < list.size(); ++i) a.Set(i, list[i]);
    return a;
  }

  Napi::Value GetPluginParams(const Napi::CallbackInfo& info) {
    Napi::Env env = info.Env();
    return pluginInfo(env, E(env).getPluginParams(args::string(env, info[0], "plugin")));
  }

  Napi::Value GetBackendParams(const Napi::CallbackInfo& info) {
    Napi::Env env = info.Env();
    return pluginInfo(env, E(env).getBackendParams(args::string(env, info[0], "backend")));
  }

  Napi::Value QueryXferBackend(const Napi::CallbackInfo& info) {
    Napi::Env env = info.Env();
    return Napi::String::New(env, E(env).queryXferBackend(PlainHandle(env, info[0], "queryXferBackend")));
  }

  static Napi::Object pluginInfo(Napi::Env env, const PluginInfo& p) {
    auto params = Napi::Object::New(env);
    for (auto& [k, v] : p.params) params.Set(k, v);
    auto mems = Napi::Array::New(env, p.memTypes.size());
    for (uint32_t i = 0; i < p.memTypes.size(); ++i) mems.Set(i, memTypeName(p.memTypes[i]));
    auto o = Napi::Object::New(env);
    o.Set("params", params);
    o.Set("memTypes", mems);
    return o;
  }

  Napi::Value CreateBackend(const Napi::CallbackInfo& info) {
    Napi::Env env = info.Env();
    E(env).createBackend(args::string(env, info[0], "plugin"), args::optParams(env, info[1], "backend params"));
    return env.Undefined();
  }

  Napi::Value GetBackends(const Napi::CallbackInfo& info) {
    Napi::Env env = info.Env();
    auto list = E(env).getBackends();
    auto a = Napi::Array::New(env, list.size());
    for (uint32_t i = 0; i < list.size(); ++i) a.Set(i, list[i]);
    return a;
  }

  // registerMem(descs, memType, backends, keepAlive[]) -> handle
  Napi::Value RegisterMem(const Napi::CallbackInfo& info) {
    Napi::Env env = info.Env();
    auto descs = args::descs(env, info[0], "registerMemory");
    if (!info[3].IsArray()) invalidArg(env, "registerMem: the memory to keep alive must be an array");
    Handle h = E(env).registerMem(descs, args::memType(env, info[1]), args::optStrings(env, info[2], "backends"));
    // The registration owns the JS memory it covers: it cannot be collected
    // while an engine may still copy into it.
    auto& keep = keep_[h];
    auto a = info[3].As<Napi::Array>();
    for (uint32_t i = 0; i < a.Length(); ++i) keep.push_back(Napi::Persistent(a.Get(i)));
    return Napi::Number::New(env, static_cast<double>(h));
  }

  Napi::Value DeregisterMem(const Napi::CallbackInfo& info) {
    Napi::Env env = info.Env();
    Handle h = args::handle(env, info[0], "registration");
    E(env).deregisterMem(h);
    keep_.erase(h);
    return env.Undefined();
  }

  Napi::Value GetLocalMD(const Napi::CallbackInfo& info) {
    Napi::Env env = info.Env();
    std::string md = E(env).getLocalMD();
    return Napi::Buffer<char>::Copy(env, md.data(), md.size());
  }

  Napi::Value LoadRemoteMD(const Napi::CallbackInfo& info) {
    Napi::Env env = info.Env();
    if (!info[0].IsTypedArray()) invalidArg(env, "metadata must be a Buffer");
    return Napi::String::New(env, E(env).loadRemoteMD(*args::optBlob(env, info[0], "metadata")));
  }

  // getLocalPartialMD(descs, memType, includeConnInfo, backends) -> Buffer
  Napi::Value GetLocalPartialMD(const Napi::CallbackInfo& info) {
    Napi::Env env = info.Env();
    std::string md = E(env).getLocalPartialMD(
        args::descs(env, info[0], "getLocalPartialMD"), args::memType(env, info[1]),
        args::boolean(env, info[2], "includeConnInfo"), args::optStrings(env, info[3], "backends"));
    return Napi::Buffer<char>::Copy(env, md.data(), md.size());
  }

  Napi::Value SendLocalMD(const Napi::CallbackInfo& info) {
    Napi::Env env = info.Env();
    E(env).sendLocalMD(args::optString(env, info[0], "ip"), args::optPort(env, info[1], "port"));
    return env.Undefined();
  }

  Napi::Value SendLocalPartialMD(const Napi::CallbackInfo& info) {
    Napi::Env env = info.Env();
    E(env).sendLocalPartialMD(args::descs(env, info[0], "sendLocalPartialMD"), args::memType(env, info[1]),
                              args::boolean(env, info[2], "includeConnInfo"),
                              args::optStrings(env, info[3], "backends"), args::optString(env, info[4], "ip"),
                              args::optPort(env, info[5], "port"), args::optString(env, info[6], "label"));
    return env.Undefined();
  }

  Napi::Value FetchRemoteMD(const Napi::CallbackInfo& info) {
    Napi::Env env = info.Env();
    E(env).fetchRemoteMD(args::string(env, info[0], "agent name"), args::optString(env, info[1], "ip"),
                         args::optPort(env, info[2], "port"), args::optString(env, info[3], "label"));
    return env.Undefined();
  }

  Napi::Value InvalidateLocalMD(const Napi::CallbackInfo& info) {
    Napi::Env env = info.Env();
    E(env).invalidateLocalMD(args::optString(env, info[0], "ip"), args::optPort(env, info[1], "port"));
    return env.Undefined();
  }

  // checkRemoteMD(agent, descs, memType) -> boolean
  Napi::Value CheckRemoteMD(const Napi::CallbackInfo& info) {
    Napi::Env env = info.Env();
    return Napi::Boolean::New(
        env, E(env).checkRemoteMD(args::string(env, info[0], "agent name"), args::descs(env, info[1], "checkRemoteMD"),
                                  args::memType(env, info[2])));
  }

  Napi::Value MakeConnection(const Napi::CallbackInfo& info) {
    Napi::Env env = info.Env();
    E(env).makeConnection(args::string(env, info[0], "agent name"));
    return env.Undefined();
  }

  // queryMem(descs, memType, backends) -> Array<Record<string,string> | null>
  Napi::Value QueryMem(const Napi::CallbackInfo& info) {
    Napi::Env env = info.Env();
    auto resp = E(env).queryMem(args::descs(env, info[0], "queryMem"), args::memType(env, info[1]),
                                args::optStrings(env, info[2], "backends"));
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
  }

  Napi::Value EstimateXferCost(const Napi::CallbackInfo& info) {
    Napi::Env env = info.Env();
    auto c = E(env).estimateXferCost(PlainHandle(env, info[0], "estimateXferCost"));
    auto o = Napi::Object::New(env);
    o.Set("durationUs", Napi::Number::New(env, static_cast<double>(c.durationUs)));
    o.Set("errMarginUs", Napi::Number::New(env, static_cast<double>(c.errMarginUs)));
    o.Set("method", Napi::String::New(env, c.method == 0 ? "ANALYTICAL_BACKEND" : "UNKNOWN"));
    return o;
  }

  Napi::Value InvalidateRemoteMD(const Napi::CallbackInfo& info) {
    Napi::Env env = info.Env();
    E(env).invalidateRemoteMD(args::string(env, info[0], "agent name"));
    return env.Undefined();
  }

  // prepXferDlist(agent | "", descs, memType, backends) -> handle
  Napi::Value PrepXferDlist(const Napi::CallbackInfo& info) {
    Napi::Env env = info.Env();
    Handle h =
        E(env).prepXferDlist(args::string(env, info[0], "agent name"), args::descs(env, info[1], "prepXferDlist"),
                             args::memType(env, info[2]), args::optStrings(env, info[3], "backends"));
    return Napi::Number::New(env, static_cast<double>(h));
  }

  Napi::Value ReleaseDlist(const Napi::CallbackInfo& info) {
    Napi::Env env = info.Env();
    E(env).releaseDlist(args::handle(env, info[0], "dlist handle"));
    return env.Undefined();
  }

  // makeXferReq(op, localDlist, localIdx, remoteDlist, remoteIdx, notif?) -> handle
  Napi::Value MakeXferReq(const Napi::CallbackInfo& info) {
    Napi::Env env = info.Env();
    XferOp op = args::op(env, info[0]);
    Handle l = args::handle(env, info[1], "local dlist handle");
    auto li = args::indices(env, info[2], "local indices");
    Handle r = args::handle(env, info[3], "remote dlist handle");
    auto ri = args::indices(env, info[4], "remote indices");
    auto notif = args::optBlob(env, info[5], "notification message");
    Handle h = E(env).makeXferReq(op, l, li.Data(), li.ElementLength(), r, ri.Data(), ri.ElementLength(),
                                  notif ? &*notif : nullptr);
    return Napi::Number::New(env, static_cast<double>(h));
  }

  // createXferReq(op, localDescs, localType, remoteDescs, remoteType, agent, notif?) -> handle
  Napi::Value CreateXferReq(const Napi::CallbackInfo& info) {
    Napi::Env env = info.Env();
    XferOp op = args::op(env, info[0]);
    auto local = args::descs(env, info[1], "local");
    MemType lt = args::memType(env, info[2]);
    auto remote = args::descs(env, info[3], "remote");
    MemType rt = args::memType(env, info[4]);
    std::string agent = args::string(env, info[5], "remote agent");
    auto notif = args::optBlob(env, info[6], "notification message");
    Handle h = E(env).createXferReq(op, local, lt, remote, rt, agent, notif ? &*notif : nullptr);
    return Napi::Number::New(env, static_cast<double>(h));
  }

  // postXferReq(handle, notif?, mayInline?) -> IN_PROG (a completion event
  // follows), or the final status of a transfer that finished inside the post
  // (no event follows). NixlAgent posts through xferPoster's function instead.
  Napi::Value PostXferReq(const Napi::CallbackInfo& info) {
    napi_value argv[3] = {info[0], info[2], info[1]};
    return Napi::Value(info.Env(), PostXfer(info.Env(), argv, 3));
  }

  // argv: handle, mayInline, notif. Without a third argument there is no
  // message, and nothing asks its type (napi_typeof runs through a dozen
  // type checks before it answers undefined).
  napi_value PostXfer(napi_env env, const napi_value* argv, size_t argc) {
    Napi::Env e(env);
    Handle h = args::handle(e, Napi::Value(env, argv[0]), "transfer handle");
    bool mayInline = args::optBoolean(e, Napi::Value(env, argv[1]), "mayInline").value_or(true);
    std::optional<std::string> notif;
    if (argc >= 3) notif = args::optBlob(e, Napi::Value(env, argv[2]), "notification message");
    int s;
    if (isLayered(h)) {
      uint32_t inProg = 0;
      s = layered_.postAll(E(e), h, notif ? &*notif : nullptr, mayInline, inlineMaxBytes_, &inProg);
      AddInflight(e, inProg);
    } else {
      s = E(e).postXferReq(h, notif ? &*notif : nullptr, mayInline);
      if (s == IN_PROG) AddInflight(e, 1);
    }
    return Int32(env, s);
  }

  static napi_value Int32(napi_env env, int32_t v) {
    napi_value out;
    if (napi_create_int32(env, v, &out) != napi_ok) fail(env, ERR_UNKNOWN, "napi_create_int32 failed");
    return out;
  }

  // makeLayeredXferReq(op, localDlist, localIdx, remoteDlist, remoteIdx, bounds, notif?, remoteAgent)
  //   -> [handle, the most bytes a layer moves (-1: unknown)]
  Napi::Value MakeLayeredXferReq(const Napi::CallbackInfo& info) {
    Napi::Env env = info.Env();
    XferOp op = args::op(env, info[0]);
    Handle l = args::handle(env, info[1], "local dlist handle");
    auto li = args::indices(env, info[2], "local indices");
    Handle r = args::handle(env, info[3], "remote dlist handle");
    auto ri = args::indices(env, info[4], "remote indices");
    auto bounds = args::indices(env, info[5], "layer bounds");
    auto notif = args::optBlob(env, info[6], "notification message");
    std::string agent = args::string(env, info[7], "remote agent");
    Handle h = layered_.make(E(env), op, l, li.Data(), li.ElementLength(), r, ri.Data(), ri.ElementLength(),
                             bounds.Data(), bounds.ElementLength(), std::move(notif), agent);
    uint64_t bytes = layered_.maxLayerBytes(h);
    auto out = Napi::Array::New(env, 2);
    out.Set(0u, Napi::Number::New(env, static_cast<double>(h)));
    out.Set(1u, Napi::Number::New(env, bytes == UINT64_MAX ? -1.0 : static_cast<double>(bytes)));
    return out;
  }

  // layerPoster() -> postLayer(handle, layer, mayInline), the request's
  // status after it: the per-layer call of a layer-wise transfer, with no
  // allocation and no event unless the engine's thread runs the layer.
  // xferPoster() -> postXfer(handle, mayInline, notif?), as postXferReq.
  // Functions of their own, not methods: a method finds its agent with
  // napi_unwrap (a private-symbol property lookup), which cost as much as a
  // layer's bookkeeping; these get it as their callback data.
  Napi::Value LayerPoster(const Napi::CallbackInfo& info) {
    return MakePoster(info.Env(), "postLayer", PostLayerCallback);
  }
  Napi::Value XferPoster(const Napi::CallbackInfo& info) {
    return MakePoster(info.Env(), "postXfer", PostXferCallback);
  }

  Napi::Value MakePoster(napi_env env, const char* name, napi_callback cb) {
    auto* data = new std::shared_ptr<PosterGate>(gate_);
    napi_value fn;
    if (napi_create_function(env, name, NAPI_AUTO_LENGTH, cb, data, &fn) != napi_ok) {
      delete data;
      fail(env, ERR_UNKNOWN, std::string(name) + ": napi_create_function failed");
    }
    auto drop = [](napi_env, void* d, void*) { delete static_cast<std::shared_ptr<PosterGate>*>(d); };
    if (napi_add_finalizer(env, fn, data, drop, nullptr, nullptr) != napi_ok) {
      delete data;  // fn is never handed out: nothing calls it with data
      fail(env, ERR_UNKNOWN, std::string(name) + ": napi_add_finalizer failed");
    }
    return Napi::Value(env, fn);
  }

  static napi_value PostLayerCallback(napi_env env, napi_callback_info cbinfo) {
    return CallPoster(env, cbinfo, &NativeAgent::PostLayer, "postLayer: the agent is gone");
  }
  static napi_value PostXferCallback(napi_env env, napi_callback_info cbinfo) {
    return CallPoster(env, cbinfo, &NativeAgent::PostXfer, "postXfer: the agent is gone");
  }

  using PosterMethod = napi_value (NativeAgent::*)(napi_env, const napi_value*, size_t);
  static napi_value CallPoster(napi_env env, napi_callback_info cbinfo, PosterMethod m, const char* gone) {
    size_t argc = 3;
    napi_value argv[3];  // missing arguments read as undefined
    void* data = nullptr;
    if (napi_get_cb_info(env, cbinfo, &argc, argv, nullptr, &data) != napi_ok) return nullptr;
    NativeAgent* self = (*static_cast<std::shared_ptr<PosterGate>*>(data))->self;
    try {
      return guard(Napi::Env(env), [&] {
        if (!self) fail(env, ERR_NOT_ALLOWED, gone);
        return (self->*m)(env, argv, argc);
      });
    } catch (const Napi::Error& e) {
      e.ThrowAsJavaScriptException();
      return nullptr;
    }
  }

  napi_value PostLayer(napi_env env, const napi_value* argv, size_t /*argc*/) {
    Handle h = args::handle(env, Napi::Value(env, argv[0]), "layered transfer handle");
    // One N-API call per argument: on 4 KiB blocks a layer's copy takes about
    // a microsecond, and each call into N-API is a few percent of it.
    double d;
    if (napi_get_value_double(env, argv[1], &d) != napi_ok) invalidArg(env, "postLayer: layer must be a number");
    if (!(d >= 0 && d < 4294967296.0) || d != static_cast<double>(static_cast<uint32_t>(d)))
      invalidArg(env, "postLayer: layer must be a non-negative integer");
    bool mayInline = true;
    if (bool b; napi_get_value_bool(env, argv[2], &b) == napi_ok) mayInline = b;
    uint32_t inProg = 0;
    int s = layered_.postLayer(E(env), h, static_cast<uint32_t>(d), mayInline, &inProg);
    AddInflight(env, inProg);
    return Int32(env, s);
  }

  void AddInflight(Napi::Env env, uint32_t n) {
    if (n == 0) return;
    inflight_ += n;
    UpdateRef(env);
  }

  // A handle of an engine request: a layered request has no single backend,
  // cost or telemetry (ask per layer with an ordinary request).
  Handle PlainHandle(Napi::Env env, const Napi::Value& v, const char* what) {
    Handle h = args::handle(env, v, "transfer handle");
    if (isLayered(h)) fail(env, ERR_NOT_SUPPORTED, std::string(what) + " is not supported on a layered transfer");
    return h;
  }

  // xferBytes(handle) -> the bytes a request moves, -1 if the engine cannot tell.
  Napi::Value XferBytes(const Napi::CallbackInfo& info) {
    Napi::Env env = info.Env();
    uint64_t bytes = E(env).xferBytes(PlainHandle(env, info[0], "xferBytes"));
    return Napi::Number::New(env, bytes == UINT64_MAX ? -1.0 : static_cast<double>(bytes));
  }

  // -> status number; on error also the message as second element.
  Napi::Value GetXferStatus(const Napi::CallbackInfo& info) {
    Napi::Env env = info.Env();
    std::string err;
    Handle h = args::handle(env, info[0], "transfer handle");
    int s;
    if (isLayered(h)) {
      bool ended = false;
      s = layered_.status(E(env), h, &err, &ended);
      // Ended here, not by a completion event: waiters still get their event.
      if (ended) {
        std::lock_guard<std::mutex> lk(mu_);
        finished_.push_back(h);
        ++inflight_;
        SignalLocked();
      }
      UpdateRef(env);
    } else {
      s = E(env).getXferStatus(h, &err);
    }
    if (s >= 0) return Napi::Number::New(env, s);
    auto a = Napi::Array::New(env, 2);
    a.Set(0u, Napi::Number::New(env, s));
    a.Set(1u, Napi::String::New(env, err));
    return a;
  }

  Napi::Value ReleaseXferReq(const Napi::CallbackInfo& info) {
    Napi::Env env = info.Env();
    Handle h = args::handle(env, info[0], "transfer handle");
    if (isLayered(h))
      layered_.release(E(env), h);
    else
      E(env).releaseXferReq(h);
    return env.Undefined();
  }

  Napi::Value GetXferTelemetry(const Napi::CallbackInfo& info) {
    Napi::Env env = info.Env();
    Telemetry t = E(env).getXferTelemetry(PlainHandle(env, info[0], "getXferTelemetry"));
    auto o = Napi::Object::New(env);
    o.Set("startTimeUs", Napi::Number::New(env, static_cast<double>(t.startTimeUs)));
    o.Set("postDurationUs", Napi::Number::New(env, static_cast<double>(t.postDurationUs)));
    o.Set("xferDurationUs", Napi::Number::New(env, static_cast<double>(t.xferDurationUs)));
    o.Set("totalBytes", Napi::Number::New(env, static_cast<double>(t.totalBytes)));
    o.Set("descCount", Napi::Number::New(env, static_cast<double>(t.descCount)));
    return o;
  }

  Napi::Value GenNotif(const Napi::CallbackInfo& info) {
    Napi::Env env = info.Env();
    std::string agent = args::string(env, info[0], "agent name");
    auto msg = args::optBlob(env, info[1], "notification message");
    if (!msg) invalidArg(env, "notification message is required");
    E(env).genNotif(agent, *msg);
    return env.Undefined();
  }

  // -> [name0, buf0, name1, buf1, ...] in arrival order
  Napi::Value GetNotifs(const Napi::CallbackInfo& info) {
    Napi::Env env = info.Env();
    std::vector<std::pair<std::string, std::string>> list;
    E(env).getNotifs(list);
    auto a = Napi::Array::New(env, list.size() * 2);
    uint32_t i = 0;
    for (auto& [from, msg] : list) {
      a.Set(i++, Napi::String::New(env, from));
      a.Set(i++, Napi::Buffer<char>::Copy(env, msg.data(), msg.size()));
    }
    return a;
  }

  Napi::Value WatchNotifs(const Napi::CallbackInfo& info) {
    Napi::Env env = info.Env();
    notifWatch_ = args::boolean(env, info[0], "watchNotifs(on)");
    if (engine_) engine_->watchNotifs(notifWatch_.load());
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
    layered_.clear();
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
  LayeredRequests layered_;
  uint32_t inlineMaxBytes_ = 0;  // AgentOptions.inlinePostMaxBytes: what a layered transfer() copies inline
  // What a layer poster (LayerPoster) holds of its agent: cleared when the
  // agent goes, so a poster kept longer fails instead of touching it.
  struct PosterGate {
    NativeAgent* self;
  };
  std::shared_ptr<PosterGate> gate_ = std::make_shared<PosterGate>(PosterGate{this});
  Tsfn tsfn_;
  TsfnCtx tsfnCtx_;
  bool haveTsfn_ = false;
  bool refd_ = false;
  uint32_t inflight_ = 0;
  std::atomic<bool> notifWatch_{false};
  std::mutex mu_;
  std::vector<Handle> finished_;
  bool notifPending_ = false;
  bool signalled_ = false;
  std::unordered_map<Handle, std::vector<Napi::Reference<Napi::Value>>> keep_;
};

}  // namespace

Napi::Function initNativeAgent(Napi::Env env) { return NativeAgent::Init(env); }

}  // namespace nixlnode
