// vLLM's histogram buckets, shared by the workers' /metrics and the proxy's
// client-side series so that both plot on vLLM's dashboards unchanged.
/** vLLM's buckets (loggers.py; NixlPromMetrics), in seconds, bytes and counts. */
export const VLLM_BUCKETS = {
  ttft: [
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0,
    640.0, 2560.0,
  ],
  itl: [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0],
  e2e: [
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0,
    1920.0, 7680.0,
  ],
  /** nixl_post_time_seconds; nixl_xfer_time_seconds takes all but the first (buckets[1:] in vLLM). */
  nixlTime: [0.001, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0, 5.0],
  /** 2 KiB to 8 GiB: 2 ** (10 + i) for i in 1, 3, ..., 23. */
  nixlBytes: Array.from({ length: 12 }, (_, k) => 2 ** (11 + 2 * k)),
  nixlDescriptors: [10, 20, 30, 50, 75, 100, 200, 400, 1000, 2000, 4000, 10000, 20000, 50000],
} as const;
