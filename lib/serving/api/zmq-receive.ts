// The receive loop of a bound ZeroMQ PULL socket, shared by the proxy's
// reply socket and a worker's request socket: each message's frames go to
// `onFrames` in order, until the socket closes (receive() then rejects).

/** What the loop needs of a socket (a zeromq Pull). */
export interface FrameSource {
  receive(): Promise<Buffer[]>;
}

/** Hands each message to `onFrames` until the socket is closed; never rejects. */
export async function receiveLoop(socket: FrameSource, onFrames: (frames: Buffer[]) => void): Promise<void> {
  for (;;) {
    let frames: Buffer[];
    try {
      frames = await socket.receive();
    } catch {
      return; // closed
    }
    onFrames(frames);
  }
}
