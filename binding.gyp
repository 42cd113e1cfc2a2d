{
  "targets": [
    {
      "target_name": "nixl_node",
      "sources": [
        "native/addon/agent.cpp",
        "native/addon/args.cpp",
        "native/addon/errors.cpp",
        "native/addon/layered.cpp",
        "native/addon/module.cpp",
        "native/loopback/copy.cpp",
        "native/loopback/live_table.cpp",
        "native/loopback/loopback_engine.cpp",
        "native/loopback/metadata.cpp",
        "native/loopback/notif_socket.cpp",
        "native/loopback/notifier.cpp",
        "native/loopback/shm.cpp"
      ],
      # The status table: generated from the installed NIXL's nixl_types.h, or
      # the checked-in fallback (native/generated) without NIXL.
      "include_dirs": ["<!(node -p \"require('node-addon-api').include_dir\")", "<!(node scripts/gen-status-table.js)"],
      "defines": ["NAPI_VERSION=8", "NAPI_CPP_EXCEPTIONS", "NODE_ADDON_API_DISABLE_DEPRECATED"],
      "cflags!": ["-fno-exceptions", "-fno-rtti"],
      "cflags_cc!": ["-fno-exceptions", "-fno-rtti", "-std=gnu++17", "-std=gnu++1y"],
      "cflags_cc": ["-std=c++20", "-fexceptions", "-frtti", "-fvisibility=hidden", "-Wall", "-Wextra", "-Wno-unused-parameter"],
      "conditions": [
        # An installed NIXL (NIXL_PREFIX, else /opt/nvidia/nvda_nixl) adds the
        # nixl engine; without it the addon is loopback-only.
        ["'<!(node scripts/find-nixl.js found)'=='1'", {
          "defines": ["NIXL_NODE_WITH_NIXL"],
          "sources": ["native/nixl/nixl_engine.cpp", "native/nixl/poller.cpp"],
          "include_dirs": ["<!(node scripts/find-nixl.js include)"],
          "libraries": [
            "-L<!(node scripts/find-nixl.js libdir)", "-lnixl", "-lnixl_build",
            "-Wl,-rpath,<!(node scripts/find-nixl.js libdir)"
          ]
        }],
        # NIXL_NODE_SANITIZE=1 builds with AddressSanitizer + UBSan (CI runs
        # the native tests under it, with libasan preloaded). UBSan's vptr
        # check is off: node-addon-api's ObjectWrap casts to the derived class
        # inside its own constructor, which it flags on every new object.
        ["'<!(node -p \"process.env.NIXL_NODE_SANITIZE || 0\")'=='1'", {
          "cflags_cc": ["-fsanitize=address,undefined", "-fno-sanitize=vptr", "-fno-omit-frame-pointer", "-g", "-O1"],
          "ldflags": ["-fsanitize=address,undefined", "-fno-sanitize=vptr"]
        }]
      ]
    }
  ]
}
