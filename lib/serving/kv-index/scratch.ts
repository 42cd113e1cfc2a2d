// The precise policy's per-decision working arrays, kept between decisions:
// a decision scores every prefill on every request, and arrays made and
// dropped there each time are garbage whose collection is the decision's
// tail latency.
import type { WorkerRef } from '../proxy/worker-ref';

export class DecisionScratch {
  /** Index i: the i-th candidate of the decision under way. */
  names: string[] = [];
  blocks = new Float64Array(0);
  weight = new Float64Array(0);
  loads = new Float64Array(0);
  held = new Float64Array(0);
  tied = new Int32Array(0);
  #n = 0;

  /** Sizes the arrays for `from` and names its candidates. */
  fill(from: readonly WorkerRef[], nameOf: (w: WorkerRef) => string): this {
    const n = from.length;
    if (this.blocks.length < n) {
      const cap = Math.max(n, this.blocks.length * 2, 8);
      this.blocks = new Float64Array(cap);
      this.weight = new Float64Array(cap);
      this.loads = new Float64Array(cap);
      this.held = new Float64Array(cap);
      this.tied = new Int32Array(cap);
    }
    this.names.length = n;
    for (let i = 0; i < n; i++) this.names[i] = nameOf(from[i]);
    this.blocks.fill(0, 0, n);
    this.weight.fill(0, 0, n);
    this.#n = n;
    return this;
  }

  /** Whether any candidate holds the prompt's first block. */
  anyMatch(): boolean {
    for (let i = 0; i < this.#n; i++) if (this.blocks[i] > 0) return true;
    return false;
  }
}
