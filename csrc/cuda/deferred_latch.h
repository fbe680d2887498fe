// Per-thread latches of deferred verification on the GPU. Each thread has one latch per device (in
// that device's memory); its deferred copies (and the graphs it captures) latch mismatches there, and
// its check_transfers() reports them: deferred errors belong to the thread that made the copy.
#pragma once

#include "pyxfer/launch.h"
#include "transfer/errors.h"

namespace pyxfer {

// The calling thread's latch on `device`, allocated on first use and never freed (a captured graph
// may replay into it at any time). `capturing`: the latch kernel is being captured into a CUDA graph,
// so every later take of this thread also waits for `device` (replays register nothing).
TransferLatch* thread_latch(int device, bool capturing);

// Waits for every device this thread's deferred copies ran on (and the devices of the graphs it
// captured), then returns the mismatches latched since its last take. Never writes a latch: a kernel
// may still write it (a replay queued by another thread after the wait is reported by a later take).
TransferErrors take_thread_latches();

}  // namespace pyxfer
