package supervise

import (
	"context"
	"errors"
	"strings"
	"sync/atomic"
	"testing"

	"github.com/tandem-llm/tandem/daemon/membership"
	"github.com/tandem-llm/tandem/daemon/placement"
	"github.com/tandem-llm/tandem/pipeline"
)

// noMembers is a Membership of nobody, for a supervisor that never runs.
type noMembers struct{}

func (noMembers) Members() []membership.Member    { return nil }
func (noMembers) Events() <-chan membership.Event { return nil }

// TestReportBlame checks the node a pipeline's failure is blamed on: the
// stage the driver named for a failure of its own or its process's end;
// for the failure of a data link (its cause is at the other end) or when
// the driver named none (a step past its deadline), a stage that does not
// answer, else the driver's guess.
func TestReportBlame(t *testing.T) {
	p := &Pipeline{Epoch: 7}
	for _, n := range []string{"s1", "s2", "s3"} {
		p.Stages = append(p.Stages, Stage{Stage: placement.Stage{Node: n}, Member: membership.Member{Name: n, Meta: membership.Meta{GRPCAddr: n + ":7000"}}})
	}
	linkErr := &pipeline.StageError{Stage: 0, Err: errors.New("stage 0 failed: stage x, batch 1: data link failed: send activations: EOF")}
	for _, tc := range []struct {
		name   string
		err    error
		silent string // the node that does not answer a probe ("": none)
		want   string
		probed bool
	}{
		{"its process died", &pipeline.StageError{Stage: 1, Err: errors.New("stage 1: connection reset by peer")}, "s2", "s2", false},
		{"its own failure", &pipeline.StageError{Stage: 2, Err: errors.New("stage 2 failed: forward: out of memory")}, "", "s3", false},
		{"a neighbour's link failure, the dead stage silent", linkErr, "s2", "s2", true},
		{"a link failure, every stage answers", linkErr, "", "s1", true},
		{"past the deadline", &pipeline.StageError{Stage: -1, Err: errors.New("no result for batch 1 within the step timeout of 2s: a stage is stuck")}, "s2", "s2", true},
		{"past the deadline, every stage answers", &pipeline.StageError{Stage: -1, Err: errors.New("no result")}, "", "", true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			var probed atomic.Bool
			s := New(Config{Probe: func(ctx context.Context, addr string) error {
				probed.Store(true)
				if tc.silent != "" && addr == tc.silent+":7000" {
					return errors.New("connection refused")
				}
				return nil
			}}, noMembers{})
			s.report(context.Background(), p, tc.err)
			ev := (<-s.events).(StageFailed)
			if ev.Node != tc.want || ev.Epoch != p.Epoch || probed.Load() != tc.probed {
				t.Fatalf("blamed %q (epoch %d, probed %t), want %q (probed %t): %v", ev.Node, ev.Epoch, probed.Load(), tc.want, tc.probed, ev.Err)
			}
			if tc.silent != "" && tc.probed && !strings.Contains(ev.Err.Error(), "on "+tc.silent+" does not answer") {
				t.Errorf("the failure %q does not say %s does not answer", ev.Err, tc.silent)
			}
		})
	}
}
