// The NativeAgent class (agent.cpp), for module.cpp to export.
#pragma once
#include <napi.h>

namespace nixlnode {
Napi::Function initNativeAgent(Napi::Env env);
}
