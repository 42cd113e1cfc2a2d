#!/usr/bin/python3
"""Writes handshake.json: byte-exact vectors for both wire profiles (lib/handshake/).

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

for req in ([b"get_meta_msg", 0], [b"get_meta_msg", 7]):
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



# ---- vLLM v12 (NIXL_CONNECTOR_VERSION 12) -----------------------------------
# msgspec encodes every dataclass field in field order, None as nil; Python's
# msgpack with a dict in that order gives the same bytes.

def meta12(engine_id, md, addrs, device_id, num_blocks, block_lens, block_strides, layout, block_size,
           ssm_sizes, backend, phys, region_num_blocks=None, region_group_ids=None, region_names=None,
           region_mem_types=None, dcp_size=1, pcp_size=1, region_members=()):
    return {
        "engine_id": engine_id,
        "agent_metadata": md,
        "kv_caches_base_addr": addrs,
        "device_id": device_id,
        "num_blocks": num_blocks,
        "block_lens": block_lens,
        "block_strides": block_strides,
        "kv_cache_layout": layout,
        "block_size": block_size,
        "ssm_sizes": list(ssm_sizes),
        "attn_backend_name": backend,
        "physical_blocks_per_logical_kv_block": phys,
        "region_num_blocks": region_num_blocks,
        "region_group_ids": region_group_ids,
        "region_names": region_names,
        "region_mem_types": region_mem_types,
        "dcp_size": dcp_size,
        "pcp_size": pcp_size,
        "region_members": [list(m) for m in region_members],
    }


metas12 = [
    meta12("prefill-0", b"\x01\x02\x03", [4096, 8192], 0, 16, [4096, 4096], [4096, 4096], "LBHNC", 16, (0, 0),
           "FLASH_ATTN", 1),
    meta12("e" * 40, bytes(range(200)), [0xFFFF_FFFF_FFFF_F000, 0x8000_0000_0000_0000, 0x7F3A_0000_0000], 3, 2000,
           [65536, 65536, 576], [131072, 65536, 576], "BLNHC", 32, (0, 0), "FLASHINFER", 2,
           region_num_blocks=[2000, 2000, 1000], region_group_ids=[0, 0, -1],
           region_names=["model.layers.2.self_attn", "model.layers.10.self_attn", "mtp.0"],
           region_mem_types=["VRAM", "VRAM", "VRAM"], dcp_size=2, pcp_size=1,
           region_members=[["model.layers.2.self_attn"], ["model.layers.10.self_attn", "x"], []]),
]

v12 = {"metadata": [], "payload": [], "request": [], "timestamp": [], "hash": [], "kv_params": []}
for m in metas12:
    b = msgpack.packb(m, use_bin_type=True)
    j = dict(m)
    j["agent_metadata"] = m["agent_metadata"].hex()
    j["kv_caches_base_addr"] = [str(a) for a in m["kv_caches_base_addr"]]
    v12["metadata"].append({"fields": j, "hex": b.hex()})
    h = hashlib.sha256(b).hexdigest()
    p = msgpack.packb({"compatibility_hash": h, "agent_metadata_bytes": b}, use_bin_type=True)
    v12["payload"].append({"compatibility_hash": h, "inner_hex": b.hex(), "hex": p.hex()})

for req in ([b"get_meta_msg", 0, 1], [b"get_meta_msg", 3, 300], [b"get_meta_msg", 0, 0]):
    v12["request"].append({"pp_rank": req[1], "tp_rank": req[2], "hex": msgpack.packb(req, use_bin_type=True).hex()})

for t in (123.25, 5.0, 0.0, 98765.4321):
    v12["timestamp"].append({"seconds": t, "hex": msgpack.packb(t).hex()})

factor_sets12 = [
    {"vllm_version": "0.26.0", "nixl_connector_version": 12, "model": "demo/llama-tiny", "dtype": "torch.bfloat16",
     "num_kv_heads": 8, "head_size": 128, "num_hidden_layers": 4, "attn_backend_name": "FLASH_ATTN",
     "cache_dtype": "auto", "is_hma_enabled": False, "speculative_config": None, "transfer_mode": "pull"},
    {"vllm_version": "0.26.1rc2", "nixl_connector_version": 12, "model": "deepseek-ai/DeepSeek-V3",
     "dtype": "torch.bfloat16", "num_kv_heads": 1, "head_size": 576, "num_hidden_layers": 61,
     "attn_backend_name": "FLASHMLA", "cache_dtype": "fp8_e4m3", "is_hma_enabled": True,
     "speculative_config": {"method": "eagle3", "model": "yuhuili/EAGLE3", "revision": None, "code_revision": None,
                            "parallel_drafting": False, "kv_cache_dtype": "auto", "auxiliary_layer_ids": [2, 30, 58]},
     "transfer_mode": "push"},
]
for f in factor_sets12:
    s = json.dumps(f, sort_keys=True)
    v12["hash"].append({"factors": f, "json": s, "sha256": hashlib.sha256(s.encode()).hexdigest()})

# kv_transfer_params as vLLM's pull scheduler returns them (request_finished).
v12["kv_params"].append({
    "do_remote_prefill": True, "do_remote_decode": False, "remote_block_ids": [[1, 2, 3]],
    "remote_engine_id": "prefill-engine", "remote_request_id": "cmpl-abc-0", "remote_host": "10.0.0.7",
    "remote_port": 5601, "tp_size": 2, "dcp_size": 1, "pp_size": 1, "remote_num_tokens": 40,
    "remote_blocks_expiry_time": None, "transfer_mode": "pull"})
v013_kv_params = {
    "do_remote_prefill": True, "do_remote_decode": False, "remote_block_ids": [1, 2, 3],
    "remote_engine_id": "prefill-engine", "remote_host": "10.0.0.7", "remote_port": 5601,
    "remote_request_id": "cmpl-abc-0", "tp_size": 2}
vectors["kv_params"] = [v013_kv_params]
vectors["v12"] = v12

with open("handshake.json", "w") as out:
    json.dump(vectors, out, indent=1)
print("wrote handshake.json (v0.13 and v12)")
