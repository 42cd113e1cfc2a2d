// The text of a generation as it streams: whole characters only, and all of
// it adding up to the class's final text.
//
// node-llama-cpp's onTextChunk detokenizes each released group of tokens on
// its own. A character whose bytes are split by a token of no text (a
// control token such as <unk> between two pieces) then arrives as U+FFFD in
// two chunks, while the final text (all tokens detokenized at once) has the
// character. This sink detokenizes everything released so far and sends
// what is new at each release, holding back a trailing U+FFFD (a character
// that may still complete): a chunk never ends in U+FFFD but the last. The
// end sends the rest of the final text.
import type * as Nlc from 'node-llama-cpp';
import type { TextSink } from '../types';

export class WholeText {
  readonly #tokens: Nlc.Token[] = [];
  #sent = '';

  constructor(
    readonly model: Nlc.LlamaModel,
    readonly out: TextSink | undefined,
  ) {}

  /** Tokens the class released (onToken). */
  readonly add = (tokens: Nlc.Token[]): void => {
    this.#tokens.push(...tokens);
    if (!this.out) return;
    let text = this.model.detokenize(this.#tokens, false);
    let end = text.length;
    while (end > this.#sent.length && text[end - 1] === '\uFFFD') end--;
    text = text.slice(0, end);
    if (text.length > this.#sent.length && text.startsWith(this.#sent)) this.#send(text);
  };

  /** The class's final text: sends what is left of it. */
  end(final: string): void {
    if (!final.startsWith(this.#sent))
      throw new Error(`the streamed text ${JSON.stringify(this.#sent)} is not how the answer starts`);
    if (this.out) this.#send(final);
    else this.#sent = final;
  }

  #send(upTo: string): void {
    const piece = upTo.slice(this.#sent.length);
    this.#sent = upTo;
    if (piece.length > 0) this.out?.(piece);
  }
}
