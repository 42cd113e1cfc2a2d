// One lookup for every handle map of both engines: the entry, or
// NIXL_ERR_NOT_FOUND saying which call looked for what.
#pragma once
#include <string>

#include "status.h"

namespace nixlnode {

template <class Map>
typename Map::mapped_type& lookup(Map& m, const typename Map::key_type& key, const char* call, const char* what) {
  auto it = m.find(key);
  if (it == m.end()) throw EngineError(ERR_NOT_FOUND, std::string(call) + ": unknown or released " + what);
  return it->second;
}

template <class Map>
const typename Map::mapped_type& lookup(const Map& m, const typename Map::key_type& key, const char* call,
                                        const char* what) {
  auto it = m.find(key);
  if (it == m.end()) throw EngineError(ERR_NOT_FOUND, std::string(call) + ": unknown or released " + what);
  return it->second;
}

}  // namespace nixlnode
