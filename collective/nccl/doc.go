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
// With Config.Ordered, Stream is the stream of the caller's own work (a
// CUDA stage's) and Send and Recv return once the transfer is on it,
// without waiting: the receive before the work that reads its buffer, the
// send after the work that wrote it, stream order keeping either buffer
// from reuse until the transfer is done (collective.StreamOrdered). They
// check the communicator's asynchronous error first; a transfer whose peer
// never comes then holds the stream until the owner aborts the
// communicator (daemon/stagehost does when the link's assignment ends).
//
// Otherwise Send and Recv return once the transfer has completed on the device. While
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
// core busy while it spins in Send or Recv (not with Config.Ordered). Send
// and Recv make their device calls on the caller's own thread with the
// device's context current (Device.LockThread), ordered by the caller's
// program order against the device goroutine's work on the same stream;
// they must not be called from inside Device.Do. The communicator may be
// aborted from another goroutine at any time (gpu.NCCLComm.P2P holds it
// through each transfer's calls). A Sender and a Receiver may share a
// communicator and a stream; the caller owns both and destroys them after
// Close.
package nccl
