package main

import (
	"bytes"
	"strings"
	"testing"
	"time"

	"google.golang.org/protobuf/types/known/durationpb"

	tandemv1 "github.com/tandem-llm/tandem/proto/tandem/v1"
)

// TestPrintScheduler checks the scheduler rows of the status table: the
// figures, the KV usage as a percentage, and no rows without a scheduler.
func TestPrintScheduler(t *testing.T) {
	for _, tc := range []struct {
		name string
		sc   *tandemv1.SchedulerStats
		want []string
	}{
		{"none", nil, nil},
		{"busy", &tandemv1.SchedulerStats{
			Running: 3, Waiting: 2, InFlight: 4, KvBlocksUsed: 48, KvBlocks: 64, BlockSize: 16,
			Preemptions: 5, DiscardedTokens: 7, Finished: 11, Cancelled: 1, Steps: 1234,
			LastStepTime: durationpb.New(1500 * time.Microsecond), MeanStepTime: durationpb.New(2 * time.Millisecond),
		}, []string{
			"requests:  3 running, 2 waiting, 11 finished, 1 cancelled\n",
			"KV cache:  48 of 64 blocks used (75.0%), 16 positions a block\n",
			"steps:     1234 done, 4 in flight, step time 1.5ms last, 2ms mean; 5 preemptions, 7 tokens discarded\n",
		}},
		{"empty cache", &tandemv1.SchedulerStats{BlockSize: 16}, []string{"KV cache:  0 of 0 blocks used (0.0%)", "step time 0s last, 0s mean"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			var b bytes.Buffer
			if err := printStatus(&b, &tandemv1.StatusResponse{Node: "n", Serving: true, Scheduler: tc.sc}); err != nil {
				t.Fatal(err)
			}
			out := b.String()
			for _, w := range tc.want {
				if !strings.Contains(out, w) {
					t.Errorf("status lacks %q:\n%s", w, out)
				}
			}
			if tc.sc == nil && (strings.Contains(out, "KV cache:") || strings.Contains(out, "steps:")) {
				t.Errorf("status without a scheduler prints scheduler rows:\n%s", out)
			}
		})
	}
}

// TestPrintLeftOut checks the status and the move answer name the stage
// nodes placement left out, with why, and the member table marks them.
func TestPrintLeftOut(t *testing.T) {
	left := []*tandemv1.LeftOutNode{
		{Node: "tiny", Reason: "(middle stage) cannot hold one layer: has 1073741824 bytes usable, needs 1074790400: short by 1048576"},
		{Node: "small", Reason: "would lower the KV capacity: with one layer (last stage: head) it holds 512 tokens, the pipeline 4096 without it"},
	}
	var b bytes.Buffer
	st := &tandemv1.StatusResponse{Node: "l", Leader: "l", Serving: true, LeftOut: left,
		Members: []*tandemv1.Member{{Name: "big", State: tandemv1.MemberState_MEMBER_STATE_ALIVE}, {Name: "tiny", State: tandemv1.MemberState_MEMBER_STATE_ALIVE}}}
	if err := printStatus(&b, st); err != nil {
		t.Fatal(err)
	}
	for _, w := range []string{
		"left out:  tiny (middle stage) cannot hold one layer: has 1073741824 bytes usable, needs 1074790400: short by 1048576\n",
		"           small would lower the KV capacity: with one layer (last stage: head) it holds 512 tokens, the pipeline 4096 without it\n",
		"tiny    alive, left out",
		"big     alive  ",
	} {
		if !strings.Contains(b.String(), w) {
			t.Errorf("status lacks %q:\n%s", w, b.String())
		}
	}
	b.Reset()
	if err := printMove(&b, &tandemv1.MoveResponse{After: []*tandemv1.PlannedStage{{Node: "big", LayerHi: 8, Estimate: true}}, LeftOut: left, Note: "dry run: nothing moved"}); err != nil {
		t.Fatal(err)
	}
	if w := "  left out: tiny (middle stage) cannot hold one layer"; !strings.Contains(b.String(), w) {
		t.Errorf("move answer lacks %q:\n%s", w, b.String())
	}
}
