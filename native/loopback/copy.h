// The copy routine of the loopback engine (copy.cpp).
#pragma once
#include <string>

#include "types.h"

namespace nixlnode::loopback {

// Copies a pinned request's bytes: memcpy (streaming stores) within this
// process and through mapped peer memfds, process_vm_readv/writev otherwise.
// Same-process peers: holds their registry's copy count, so closing them
// waits. Other processes: checks the peer's liveness words before and after.
// Returns SUCCESS or an error status with *err set.
int copyRequest(Request& req, std::string* err);

}  // namespace nixlnode::loopback
