// Peer access between GPUs: asked once per pair, enabled explicitly (never silent staging by the
// driver), safe to call while a stream captures a CUDA graph.
#pragma once

namespace pyxfer {

// Whether GPU `from` can map GPU `to`'s memory (cudaDeviceCanAccessPeer, cached per ordered pair).
bool can_access_peer(int from, int to);

// Enables access both ways between GPUs a and b (once per pair; the last pair is remembered per
// thread, so repeated copies take no lock). Both must be able to (can_access_peer).
void enable_peer_access(int a, int b);

}  // namespace pyxfer
