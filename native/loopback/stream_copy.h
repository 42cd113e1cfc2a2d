// Copies for the loopback engine. Large copies use non-temporal (streaming)
// stores: the destination is KV cache that the CPU will not read back soon,
// and streaming skips the read-for-ownership of every destination line, which
// is what glibc's memcpy does for very large sizes but not for the 16 KiB-2 MiB
// blocks a KV transfer is made of (measured: 0.7-0.8x -> see npm run bench).
#pragma once
#include <cstddef>
#include <cstdint>
#include <cstring>

#if defined(__has_feature)
#if __has_feature(address_sanitizer)
#define NIXL_NODE_SANITIZED 1
#endif
#endif
#if defined(__SANITIZE_ADDRESS__)
#define NIXL_NODE_SANITIZED 1
#endif
// ASan does not see streaming stores: sanitized builds copy with memcpy.
#if (defined(__x86_64__) || defined(__SSE2__)) && !defined(NIXL_NODE_SANITIZED)
#include <emmintrin.h>
#define NIXL_NODE_STREAM_COPY 1
#endif

namespace nixlnode {

constexpr size_t kStreamMin = 4096;

inline void streamCopy(void* dstv, const void* srcv, size_t n) {
#ifdef NIXL_NODE_STREAM_COPY
  if (n >= kStreamMin) {
    auto* dst = static_cast<char*>(dstv);
    auto* src = static_cast<const char*>(srcv);
    // Align the destination to a cache line with an ordinary copy.
    size_t head = (64 - (reinterpret_cast<uintptr_t>(dst) & 63)) & 63;
    memcpy(dst, src, head);
    dst += head;
    src += head;
    n -= head;
    size_t lines = n / 64;
    for (size_t i = 0; i < lines; ++i, dst += 64, src += 64) {
      __m128i a = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src));
      __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + 16));
      __m128i c = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + 32));
      __m128i d = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + 48));
      _mm_stream_si128(reinterpret_cast<__m128i*>(dst), a);
      _mm_stream_si128(reinterpret_cast<__m128i*>(dst + 16), b);
      _mm_stream_si128(reinterpret_cast<__m128i*>(dst + 32), c);
      _mm_stream_si128(reinterpret_cast<__m128i*>(dst + 48), d);
    }
    memcpy(dst, src, n - lines * 64);
    return;
  }
#endif
  memcpy(dstv, srcv, n);
}

// Makes streamed stores visible before the transfer is reported complete.
inline void streamFence() {
#ifdef NIXL_NODE_STREAM_COPY
  _mm_sfence();
#endif
}

}  // namespace nixlnode
