// Package nccl carries activations between pipeline stages on GPUs with
// NCCL point-to-point transfers: Sender and Receiver implement
// collective.Sender and collective.Receiver for device buffers, ordered on
// a CUDA stream of the caller's.
//
// NCCL does not carry headers: both ends state the header they expect from
// the batch description the control plane gave them, and the receiver
// trusts it; the buffer sizes are checked against it on each side.
//
// # Usage
//
// Rank 0 makes an id and hands its bytes to the other rank over the control
// plane; both join the communicator on their device, then wrap it:
//
//	id, _ := nccl.NewUniqueID()           // rank 0
//	wire := nccl.EncodeUniqueID(id)       // sent to rank 1
//	id, err := nccl.DecodeUniqueID(wire)  // rank 1
//	comm, err := nccl.Connect(ctx, dev, 2, id, rank)
//	s, err := nccl.NewSender(nccl.Config{Device: dev, Comm: comm, Peer: 1, Stream: stream})
//	err = s.Send(ctx, hdr, activations) // activations: a gpu.Mem
//
// Send and Recv return once the transfer has completed on the device. While
// they wait they check the transfer's completion event and the
// communicator's asynchronous error: back to back for Config.Spin (10 ms),
// so that a wait as long as a neighbour's step ends within microseconds of
// the transfer (a Go timer sleep lasts about 1 ms however short it is asked
// to be), then once per Config.Sleep. When a check reports an error or ctx
// ends first, they abort the communicator (it cannot be used again: the
// control plane must make a new one) and return an error, so a lost peer
// never hangs the caller. Connect makes a non-blocking communicator, with
// which joining and connection setup are bounded by ctx too; with a
// blocking one (gpu.NCCLInitRank) they block inside NCCL until the peer
// shows up.
//
// # Concurrency
//
// A Sender or Receiver is used by one goroutine at a time, which keeps a CPU
// core busy while it spins in Send or Recv. Send and Recv run their device
// calls through Config.Device.Do, so they must not be called from inside
// Do. A Sender and a Receiver may share a communicator and a stream; the
// caller owns both and destroys them after Close.
package nccl
