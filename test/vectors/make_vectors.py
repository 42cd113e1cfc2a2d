#!/usr/bin/python3
"""Writes handshake.json: byte-exact vectors for lib/handshake/codec.ts.

Made with Python's msgpack (use_bin_type=True: the same minimal encoding as
msgspec, which vLLM uses) and vLLM's hash_factors
(sha256 of json.dumps(factors, sort_keys=True)). Rerun: /usr/bin/python3 make_vectors.py
"""
import hashlib
import json

import msgpack


def meta(engine_id, md, addrs, device_id, num_blocks, block_lens, layout, block_size):
    # Field order of vLLM's NixlAgentMetadata dataclass.
    return {
        "engine_id": engine_id,
        "agent_metadata": md,
        "kv_caches_base_addr": addrs,
        "device_id": device_id,
        "num_blocks": num_blocks,
        "block_lens": block_lens,
        "kv_cache_layout": layout,
        "block_size": block_size,
    }


metas = [
    meta("prefill-0", b"\x01\x02\x03", [4096, 8192], 0, 16, [4096, 4096], "HND", 16),
    meta("e" * 40, bytes(range(256)) + b"x" * 44, [0x7F3A_0000_0000 + i * (1 << 24) for i in range(64)], 3,
         1000, [262144] * 64, "NHD", 128),
    meta("mla", b"", [0xFFFF_FFFF_FFFF_F000, 0xFFFF_FFFF, 0x1_0000_0000], 65535, 70000, [576 * 2 * 16], "HND", 16),
]

vectors = {"metadata": [], "payload": [], "request": [], "hash": []}
for m in metas:
    b = msgpack.packb(m, use_bin_type=True)
    vectors["metadata"].append({
        "engine_id": m["engine_id"], "agent_metadata": m["agent_metadata"].hex(),
        "kv_caches_base_addr": [str(a) for a in m["kv_caches_base_addr"]], "device_id": m["device_id"],
        "num_blocks": m["num_blocks"], "block_lens": m["block_lens"], "kv_cache_layout": m["kv_cache_layout"],
        "block_size": m["block_size"], "hex": b.hex(),
    })
    h = hashlib.sha256(b).hexdigest()
    p = msgpack.packb({"compatibility_hash": h, "agent_metadata_bytes": b}, use_bin_type=True)
    vectors["payload"].append({"compatibility_hash": h, "inner_hex": b.hex(), "hex": p.hex()})

for req in ([b"get_meta_msg", 0], [b"get_meta_msg", 7], [b"get_meta_msg", 1, 300]):
    vectors["request"].append({"ranks": req[1:], "hex": msgpack.packb(req, use_bin_type=True).hex()})

factor_sets = [
    {"vllm_version": "0.13.0", "nixl_connector_version": 2, "model": "meta-llama/Llama-3.1-8B-Instruct",
     "dtype": "torch.bfloat16", "num_kv_heads": 8, "head_size": 128, "num_hidden_layers": 32,
     "attn_backend_name": "FLASH_ATTN", "cache_dtype": "auto"},
    {"vllm_version": "0.13.0", "nixl_connector_version": 2, "model": "/models/Qwen\u00e9 \"quoted\"\\\n\u2603\U0001F600",
     "dtype": "torch.float16", "num_kv_heads": 1, "head_size": 576, "num_hidden_layers": 61,
     "attn_backend_name": "FLASHMLA", "cache_dtype": "fp8_e4m3", "extra": {"b": [1, 2.5, None, True], "a": False}},
]
for f in factor_sets:
    s = json.dumps(f, sort_keys=True)
    vectors["hash"].append({"factors": f, "json": s, "sha256": hashlib.sha256(s.encode()).hexdigest()})

with open("handshake.json", "w") as out:
    json.dump(vectors, out, indent=1)
print("wrote handshake.json")
