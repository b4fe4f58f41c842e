// Package collective carries activations from one pipeline stage to the
// next.
//
// A link is directed: a Sender at stage k, a Receiver at stage k+1. Both
// ends know every message's Header (batch id and shape) from the batch
// description, so the receiver states what it expects and receives straight
// into the stage's persistent Buffer. Messages arrive in the order they were
// sent.
//
// This package has two host-memory transports; a device transport (NCCL)
// implements the same interfaces elsewhere.
//
//   - Pipe links stages in one process: Send copies the payload into a
//     bounded queue, so a fast sender is held back (backpressure) and its
//     buffer is free as soon as Send returns.
//   - Listen/Accept and Dial link processes over TCP, one connection per
//     link. A handshake checks the protocol version and a link name both
//     ends agree on, so a stray or misdirected connection is rejected, and,
//     with a cluster credential (ListenConfig and DialConfig Credential and
//     Epoch), runs a mutual challenge-response bound to the link name and
//     epoch (package linkauth), so only a cluster member can open it. Each
//     message travels as a frame (header, payload, CRC-32C) that the
//     receiver checks against the header it expects before it reads the
//     payload into the caller's buffer; see frame.go for the wire format.
//
// A TCP link that fails (a peer gone, a corrupted or cut frame, a
// cancellation in the middle of a frame) is broken for good: every later
// call on that end returns the same error, and the pipeline must rebuild
// the link. Only a call that fails before moving a byte of its frame
// (invalid arguments, a context already done or cancelled while idle)
// leaves the link usable.
//
// # Usage
//
// In one process:
//
//	send, recv := collective.Pipe(2)
//
// Across processes, the receiving stage listens and the sending stage
// dials, both naming the link:
//
//	ln, err := collective.ListenConfig{Link: "stage1->stage2"}.Listen(":7001")
//	...
//	recv, err := ln.Accept(ctx)
//
//	send, err := collective.DialConfig{Link: "stage1->stage2"}.Dial(ctx, "host2:7001")
//
// Then, every step:
//
//	h := collective.Header{Batch: id, Rows: tokens, Cols: hidden, DType: collective.BF16}
//	err := send.Send(ctx, h, out)   // stage k
//	err := recv.Recv(ctx, h, in)    // stage k+1
//
// The context's deadline and cancellation bound every call.
//
// # Concurrency
//
// One goroutine sends on a Sender and one receives on a Receiver. Close may
// be called from any goroutine, also while a Send or Recv is blocked: it
// unblocks that call with an error wrapping ErrClosed, and the other end's
// blocked and later calls fail with ErrClosed too (a receiver first gets
// the messages sent before the sender closed). A Listener serves one Accept
// at a time; Close unblocks it. Close releases every goroutine an end owns.
package collective
