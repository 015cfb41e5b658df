// pdkv/stream.h (public, for users): a layer-wise streaming write, opened before the
// KV exists. The producer posts layers as they are computed (prefill writes layer i's
// K/V, then post_layers(i, 1)); each posted range is planned and posted as an ordinary
// transfer (Agent::prepare_blocks + Agent::post with PlanOptions::first_layer /
// num_layers), so routing, bounds checks, block generations and every transport work
// as for Agent::post. The notification goes out only after every layer has landed.
//
//   auto s = agent->open_stream(peer, {"kv", ids}, {"kv", remote_ids}, {}, {}, "req-42", 30.0);
//   for (uint32_t l = 0; l < layers; ++l) { compute(l); (void)(*s)->post_layers(l, 1); }
//   (void)(*s)->close();               // every layer posted exactly once
//   (*s)->transfer()->wait(-1);        // done: every byte landed, then the notification
//
// Batching: a posted range is sent at once while fewer than max_inflight_batches
// transfers of this stream are in flight; layers posted meanwhile wait and leave
// together, as one transfer per run of adjacent layers, when one of those completes.
//
// Notification ordering: the stream's notification is sent (Agent::send_notification)
// only after every batch transfer has completed, i.e. every byte was confirmed landed;
// it does not rely on any transport ordering data and notifications, so it holds on
// every transport. It costs one extra notification round after the last batch.
//
// Progress for a receiver that wants to start early: with progress_prefix set, each
// batch transfer carries its own notification progress_prefix + "<first>-<end>" (the
// layer range [first, end) in decimal), delivered by the transport after that batch's
// bytes landed, exactly like a transfer's notification.
//
// Failures: as a Transfer's. Any batch failing (dead peer, timeout, stale block,
// cancel) fails the stream with that batch's error; the other batches are cancelled,
// later post_layers()/close() return that error at once, and the notification is never
// sent. One deadline covers the whole stream (from open to the notification's
// delivery): posting or closing too late fails it with Timeout; nothing waits forever.
//
// Lifetime: transfer() is the stream's state, like an ordinary Transfer's: terminal only
// when no batch can touch memory any more. Dropping the StreamingWrite before close()
// cancels it; after close() it completes on its own. A stream used after its Agent was
// destroyed fails with ConnectionError ("agent is shutting down") and touches nothing.
//
// Thread safety: every method may be called from any thread.
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "pdkv/status.h"
#include "pdkv/transfer.h"

namespace pdkv {

class StreamCore;  // stream.cc

// How a stream batches its layers.
struct StreamOptions {
  // Layers posted but not yet sent wait (for more layers, or close()) while they hold
  // fewer bytes than this; 0 = send whatever is ready. Bounds the number of transfers
  // when single layers are small.
  uint64_t min_batch_bytes = 0;
  // Most batch transfers of this stream in flight at once (>= 1). Layers posted while
  // this many are in flight are sent together when one completes.
  uint32_t max_inflight_batches = 4;
  // Non-empty: each batch carries the notification progress_prefix + "<first>-<end>".
  std::string progress_prefix;

  // InvalidArgument naming the field: max_inflight_batches 0. (progress_prefix's
  // length is checked at open, against the agent's max_notif_bytes.)
  Status validate() const;
};

class StreamingWrite final {
 public:
  explicit StreamingWrite(std::shared_ptr<StreamCore> core);
  // Cancels the stream unless close() was called.
  ~StreamingWrite();
  StreamingWrite(const StreamingWrite&) = delete;
  StreamingWrite& operator=(const StreamingWrite&) = delete;

  // Marks layers [first, first + count) ready and sends them (now, or batched with the
  // next ready ones; see the header comment). Returns at once.
  // Errors: OutOfRange (layers outside the stream's), InvalidArgument (count 0, a layer
  // posted twice, the stream already closed), or the stream's own error once it failed.
  Status post_layers(uint32_t first, uint32_t count);
  // Declares the stream complete: every layer must have been posted exactly once
  // (else InvalidArgument naming the missing layers, and the stream stays open). The
  // notification given at open is sent once every layer has landed. Returns at once.
  Status close();
  // As close(), sending `notif` instead of the notification given at open ("" = none).
  Status close(std::string notif);
  // Cancels: layers not yet sent are dropped, batches in flight are cancelled, no
  // notification is sent; transfer() becomes kCancelled (kDone if everything, the
  // notification included, had already been sent).
  void cancel();

  // The stream's state as a Transfer: bytes_total = every layer's bytes, bytes_done
  // grows as batches land; terminal once the notification was delivered or the stream
  // failed and no batch is in flight any more. Its cancel() cancels the stream.
  // wire_bytes() sums the landed batches' wire bytes; compression() is the codec of the
  // last landed batch that was compressed ("" if none was).
  const std::shared_ptr<Transfer>& transfer() const;

  uint32_t first_layer() const;
  uint32_t num_layers() const;
  // Bytes of one layer (the same for every layer of a stream).
  uint64_t layer_bytes() const;
  uint32_t layers_posted() const;
  // Layers whose batch completed (their bytes landed).
  uint32_t layers_landed() const;
  // Batch transfers posted so far.
  uint32_t batches_posted() const;
  // Seconds the stream had bytes on the wire: the union of its landed batches' and its
  // notification's transfer intervals (post to completion each), <= transfer()'s
  // elapsed_s(). Grows as batches land.
  double wire_s() const;
  // Seconds from the producer's last call (the later of the last layer's post and
  // close()) to the stream's completion (the notification delivered): what the stream
  // adds once its producer is done. 0 until the stream is done; <= transfer()'s
  // elapsed_s().
  double tail_s() const;
  bool closed() const;

 private:
  std::shared_ptr<StreamCore> core_;
};

}  // namespace pdkv
