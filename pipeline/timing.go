package pipeline

import (
	"time"
)

// StageTiming is a stage's own account of one step, on its own clock: a
// monotonic clock that starts with the stage's worker, which the leader
// never assumes to agree with its own (see Observer). Each pair of times
// brackets one phase of the step; a phase the step did not have is empty
// (its start equals its end).
type StageTiming struct {
	// Waited is when the worker began waiting for the step (it asked its
	// control link for the next one); Got is when the step came.
	Waited, Got time.Duration
	// HandoffStart to HandoffEnd: the first stage receiving and applying
	// the hand-offs the step awaits.
	HandoffStart, HandoffEnd time.Duration
	// RecvStart to RecvEnd: receiving the step's activations from the
	// previous stage.
	RecvStart, RecvEnd time.Duration
	// ForwardStart to ForwardEnd: the forward pass (Stage.Forward).
	ForwardStart, ForwardEnd time.Duration
	// SendStart to SendEnd: sending the activations to the next stage,
	// and on the last stage the step's hand-off to the first.
	SendStart, SendEnd time.Duration
	// Device is the device time of the forward pass, as the stage measured
	// it (0: not measured, as on the CPU).
	Device time.Duration
	// Busy and DeviceBusy are the sums of the forward passes' times and of
	// their device times since the worker started, this step's included:
	// the stage's busy time, whose rate is the fraction of time it
	// computes.
	Busy, DeviceBusy time.Duration
}

// DeviceTimer is a stage that measures the device time of its forward
// passes (the CUDA backend, with events around its work).
type DeviceTimer interface {
	// LastStepTime is the device time of the last Forward.
	LastStepTime() time.Duration
}

// Observer sees the steps a Driver sends and the stages' accounts of them
// (DriverOptions.Observer): the leader's step tracing and the stages' busy
// time. Its methods are called from the Driver's goroutines (Submitting
// from Submit's caller, Reported from one goroutine per link) and must
// return at once.
type Observer interface {
	// Submitting is called before a step that carries sequences goes to
	// the stages, with the time; true asks every stage to report its
	// timing of the step (Step.Report).
	Submitting(s *Step, at time.Time) bool
	// Reported is called with a stage's timing of a step and the time it
	// reached the driver. With the time the step was submitted, it bounds
	// the offset between the stage's clock and the leader's: the stage got
	// the step after it was submitted, and reported before it arrived.
	Reported(stage int, batch uint64, t *StageTiming, at time.Time)
}

// clock is a worker's monotonic clock.
type clock struct{ start time.Time }

func (c *clock) now() time.Duration { return time.Since(c.start) }
