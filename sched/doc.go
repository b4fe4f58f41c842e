// Package sched is the leader's scheduler: continuous batching over a
// paged KV cache, with several steps in flight in the pipeline.
//
// The core, Scheduler, is synchronous: no goroutines, time read through an
// injected clock. Requests wait in arrival order; each step (Schedule) takes
// the running requests' decodes first, then their prefill chunks, then
// admits waiting requests, within a token budget (MaxNumBatchedTokens) and
// MaxNumSeqs, so long prompts are prefilled in chunks over several steps
// and never starve decodes. Requests join between steps; a finished or
// cancelled request leaves at once and frees everything.
//
// The scheduler owns every sequence's block table (stage.Seq.Blocks): a
// block holds BlockSize positions, and a block id means the same block on
// every stage, each storing its own layers' keys and values in it. The
// capacity, NumBlocks, is the least any stage reported. A request that
// needs a block when none is free preempts the newest running request by
// recompute: its blocks are freed and it goes back to waiting with its
// prompt and generated tokens, which it prefills again when admitted; the
// index of its next sample continues where it stopped, so seeded sampling
// gives the same tokens as an uninterrupted run.
//
// Admission keeps KV pressure from thrashing. A new request is admitted
// only if it and every running request can grow to their expected lengths:
// the prompt plus MaxTokens scaled by the fraction of MaxTokens finished
// requests actually generated (a moving average, 1 until requests finish,
// so at first every request is expected to run to MaxTokens), and at least
// GrowthReserve positions (a block) past where each stands. A preempted
// request comes back only when every running request, itself included, can
// grow to its last position, so it runs to its end, and newer requests
// wait behind it (admission is in arrival order). The victim of a
// preemption is the newest running request preempted fewer than
// MaxPreemptions times (once by default), so running requests keep
// running. The steps in flight share the requests that run, not those
// admission holds back. With 16 requests of 1,500 positions and room for
// 5, at concurrency 16 the work takes the best fixed concurrency's time
// (1.00 in simulation, BenchmarkKVPressure; 1.18 with GrowthReserve
// headroom alone, 7.9 and 504 preemptions with greedy admission); requests
// that stop long before MaxTokens are soon admitted by the dozen
// (TestAdmissionLearnsLengths). At most MaxNumWaiting requests wait (1024
// by default): Add refuses more with ErrQueueFull, which callers map to
// RESOURCE_EXHAUSTED (HTTP 429), so the leader's memory stays bounded
// under any overload.
//
// A sample a stage could not draw (stage.Sampled.Err: non-finite logits)
// ends its request alone with an error wrapping ErrRequestFailed (INTERNAL
// for the caller); the rest of the step is delivered as usual.
//
// Scheduling is asynchronous: up to MaxConcurrentBatches steps are in
// flight, and step N+1 is planned while step N runs. A request whose token
// is scheduled but not yet known holds a placeholder. Without on-device
// hand-off the steps in flight carry disjoint requests (a request's next
// chunk is scheduled only once its previous one has come back), and the
// running requests are spread evenly over the steps in flight so that a
// p-stage pipeline with p steps in flight keeps every stage busy. With
// OnDeviceHandoff a request's next decode is scheduled at once with
// stage.Placeholder as input, which the first stage fills on the device;
// tokens sampled past a stop found later are dropped, never delivered.
// With more than two steps in flight (a pipeline of p stages runs p+1),
// the running requests form MaxConcurrentBatches-1 groups that take
// turns: a request's next step goes that many steps after its last, so it
// waits on the first stage for its token while the other groups' steps
// run, not behind its own previous step, and the step in flight beyond p
// hides the round trip of results through the leader. At most
// HandoffSlots requests run with hand-off, one per slot: with p·MaxNumSeqs
// slots, each of p groups fills its steps. The groups, like the disjoint
// steps, are sized by the requests that will run, never by those waiting
// beyond MaxNumSeqs·p (or the slots): counted, they would put every
// running request into one group and leave the other steps empty.
//
// The hand-off (see stage.HandoffReceiver and pipeline.Worker): each
// running request holds a slot (stage.Seq.Slot) in [0, HandoffSlots) from
// admission until it finishes, is cancelled or is preempted (a resumed
// request takes a slot anew and prefills again, so no placeholder refers
// to a token from before). Every step that samples sets Batch.Handoff: its
// last stage returns (slot, token) rows, which reach the first stage in
// step order. A step's Step.AwaitHandoff is the number of hand-off steps
// the first stage must have applied before running it: up to the one
// holding the sample each of its placeholders stands for, and at least
// every hand-off step whose result the leader has received (its rows were
// sent before the result), so no more than MaxConcurrentBatches messages
// ever wait on the ring link. Without OnDeviceHandoff every Slot is 0.
// Whatever a request has in flight when it is preempted, cancelled or
// finished is dropped on its return (Stats.Discarded counts it). Freed
// blocks may be reused by the very next step: every stage runs steps in
// order, so it is done with a block before a later step writes it.
//
// The scheduler deals in tokens only: stop strings are the caller's, which
// detokenises a request's stream and cancels the request when one
// appears. A request that can never run (longer than MaxModelLen or the
// whole KV cache) is refused with an error wrapping ErrTooLarge.
//
// Loop runs a Scheduler against an Executor (a *pipeline.Driver) and gives
// each request a Stream of its tokens. With LoopOptions.Observer it tells
// when it scheduled and submitted each step, when it took each result and
// when each request had its first token (tracing, package
// daemon/steptrace).
//
// Requests outlive a pipeline. Replace moves the scheduler onto a new one
// (a stage died, or the layers moved): the steps in flight are abandoned,
// every running request goes back to waiting by recompute, as a
// preemption does, and prefills its prompt and the tokens delivered so far
// on the new pipeline, whose KV capacity, steps in flight and hand-off may
// differ; since the index of a request's next sample continues, its
// stream goes on with no token repeated or skipped, and seeded sampling
// gives the tokens of an uninterrupted run. With LoopOptions.OnFailure a
// failed executor parks the requests (new ones queue) until Loop.Replace
// brings a new one, or Loop.FailAll ends them with the caller's reason.
//
// # Usage
//
//	l, err := sched.Start(sched.Config{
//		MaxNumBatchedTokens: 512, MaxNumSeqs: 64,
//		NumBlocks: minBlocksOverStages, MaxConcurrentBatches: driver.Stages(),
//	}, driver)
//	...
//	defer l.Close()
//	s, err := l.Submit(ctx, sched.Request{Prompt: ids, MaxTokens: 128, StopTokens: eos})
//	for {
//		o, err := s.Recv(ctx)
//		if err == io.EOF { break }
//		...
//	}
//	fmt.Println(l.Stats().Running)
//
// # Concurrency
//
// A Scheduler is used by one goroutine. A Loop owns the loop goroutine,
// which alone uses the Scheduler and calls Executor.Submit, and, while it
// has an executor, a waiter that calls Executor.Wait once per step in
// flight (Replace stops the old executor's waiter before it returns, so
// the caller may then close that executor); Close stops both and waits
// for them. OnFailure is called on the loop goroutine. Cancelling a request's context queues its
// cancellation through a goroutine of context.AfterFunc that ends as soon
// as the loop takes it or has stopped. Submit, Stats, Done, Err, Close and
// Stream.Recv are safe for concurrent use; the loop never waits for a
// stream's reader.
package sched
