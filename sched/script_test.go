package sched_test

import (
	"fmt"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/tandem-llm/tandem/internal/golden"
	"github.com/tandem-llm/tandem/pipeline"
	"github.com/tandem-llm/tandem/sched"
	"github.com/tandem-llm/tandem/stage"
)

// TestScripts runs the golden scripts in testdata against the scheduler
// core. A script is a list of commands, one a line; the lines indented by
// two spaces after a command are what it must print. # starts a comment.
//
//	config tokens=N seqs=N block=N blocks=N batches=N maxlen=N handoff=0|1 slots=N
//	       reserve=N waiting=N preemptions=N
//	add ID prompt=N max=N [stop=T,T] [check=repeat] [seed=N]
//	    (the prompt is ID·100, ID·100+1, ...)
//	schedule           print the next step, or "none"; with handoff=1
//	                   also whether it asks for a hand-off, its
//	                   AwaitHandoff and each sequence's slot
//	complete [ID=T...] return the oldest step's result: the given tokens,
//	                   and token 1 for sampled sequences not named; T "nan"
//	                   is a sample the stage failed (non-finite logits)
//	cancel ID
//	fail ID            end the request for a reason of the caller's
//	replace tokens=N seqs=N block=N blocks=N batches=N maxlen=N handoff=0|1
//	                   move onto a new pipeline (Scheduler.Replace): the
//	                   steps in flight are abandoned; prints the requests
//	                   that no longer fit
//	tick DURATION      advance the clock
//	stats
//
// go test -run TestScripts -update rewrites the expected lines.
func TestScripts(t *testing.T) {
	golden.Run(t, runScript)
}

// runScript runs the commands of a script and returns it with each
// command's expected lines replaced by what it printed.
func runScript(t *testing.T, script string) string {
	var out strings.Builder
	var sc *sched.Scheduler
	now := time.Date(2000, 1, 1, 0, 0, 0, 0, time.UTC)
	clock := func() time.Time { return now }
	var last []*pipeline.Step // steps in flight, oldest first
	handoff := false
	for n, line := range strings.Split(strings.TrimSuffix(script, "\n"), "\n") {
		if strings.HasPrefix(line, "  ") {
			continue // expected output, replaced below
		}
		out.WriteString(line + "\n")
		if line == "" || strings.HasPrefix(line, "#") {
			continue
		}
		print := func(format string, a ...any) { fmt.Fprintf(&out, "  "+format+"\n", a...) }
		f := strings.Fields(line)
		args := map[string]string{}
		for _, kv := range f[1:] {
			k, v, _ := strings.Cut(kv, "=")
			args[k] = v
		}
		num := func(k string) int {
			if args[k] == "" {
				return 0
			}
			v, err := strconv.Atoi(args[k])
			if err != nil {
				t.Fatalf("line %d: %s: %v", n+1, k, err)
			}
			return v
		}
		if f[0] != "config" && sc == nil {
			t.Fatalf("line %d: %s before config", n+1, f[0])
		}
		cfg := func() sched.Config {
			return sched.Config{
				MaxNumBatchedTokens: num("tokens"), MaxNumSeqs: num("seqs"), BlockSize: num("block"),
				NumBlocks: num("blocks"), MaxConcurrentBatches: num("batches"), MaxModelLen: num("maxlen"),
				OnDeviceHandoff: args["handoff"] == "1", GrowthReserve: num("reserve"), MaxNumWaiting: num("waiting"), HandoffSlots: num("slots"),
				MaxPreemptions: num("preemptions"),
			}
		}
		switch f[0] {
		case "config":
			var err error
			sc, err = sched.New(cfg(), clock)
			if err != nil {
				print("error: %v", err)
			}
			last = nil
			handoff = args["handoff"] == "1"
		case "replace":
			dropped, err := sc.Replace(cfg())
			if err != nil {
				print("error: %v", err)
				continue
			}
			print("dropped %v", dropped)
			last = nil
			handoff = args["handoff"] == "1"
		case "add":
			id, err := strconv.ParseUint(f[1], 10, 64)
			if err != nil {
				t.Fatalf("line %d: id: %v", n+1, err)
			}
			r := sched.Request{ID: id, Prompt: make([]int32, num("prompt")), MaxTokens: num("max"), Sampling: stage.Sampling{Seed: uint64(num("seed"))}}
			for i := range r.Prompt {
				r.Prompt[i] = int32(id*100) + int32(i)
			}
			if s := args["stop"]; s != "" {
				for _, v := range strings.Split(s, ",") {
					tok, err := strconv.Atoi(v)
					if err != nil {
						t.Fatalf("line %d: stop: %v", n+1, err)
					}
					r.StopTokens = append(r.StopTokens, int32(tok))
				}
			}
			if err := sc.Add(r); err != nil {
				print("error: %v", err)
			}
		case "schedule":
			st, ok := sc.Schedule()
			if !ok {
				print("none")
				continue
			}
			head := fmt.Sprintf("batch %d free %v", st.Batch.ID, st.Free)
			if handoff {
				head += fmt.Sprintf(" handoff %v await %d", st.Batch.Handoff, st.AwaitHandoff)
			}
			print("%s", head)
			for _, q := range st.Batch.Seqs {
				s := fmt.Sprintf("seq %d pos %d tokens %s blocks %v", q.ID, q.Pos, tokenList(q.Tokens), q.Blocks)
				if q.Sample {
					s += fmt.Sprintf(" sample %d", q.Index)
				}
				if handoff {
					s += fmt.Sprintf(" slot %d", q.Slot)
				}
				print("%s", s)
			}
			if len(st.Batch.Seqs) > 0 {
				last = append(last, st)
			}
		case "complete":
			r := &pipeline.Result{Batch: 999}
			if len(last) > 0 {
				r.Batch = last[0].Batch.ID
				for _, q := range last[0].Batch.Seqs {
					if q.Sample {
						tok := 1
						v, ok := args[strconv.FormatUint(q.ID, 10)]
						if ok && v == "nan" {
							r.Sampled = append(r.Sampled, stage.Sampled{Seq: q.ID, Err: "non-finite logits"})
							continue
						}
						if ok {
							tok, _ = strconv.Atoi(v)
						}
						r.Sampled = append(r.Sampled, stage.Sampled{Seq: q.ID, Token: int32(tok)})
					}
				}
			}
			outs, err := sc.Complete(r)
			if err != nil {
				print("error: %v", err)
				continue
			}
			last = last[1:]
			if len(outs) == 0 {
				print("nothing")
			}
			for _, o := range outs {
				if o.Err != nil {
					print("out %d #%d error: %v", o.ID, o.Index, o.Err)
					continue
				}
				s := fmt.Sprintf("out %d #%d token %d", o.ID, o.Index, o.Token.Token)
				if o.Finish != "" {
					s += " " + o.Finish
				}
				print("%s", s)
			}
		case "cancel":
			id, _ := strconv.ParseUint(f[1], 10, 64)
			print("%v", sc.Cancel(id))
		case "fail":
			id, _ := strconv.ParseUint(f[1], 10, 64)
			print("%v", sc.Fail(id))
		case "tick":
			d, err := time.ParseDuration(f[1])
			if err != nil {
				t.Fatalf("line %d: %v", n+1, err)
			}
			now = now.Add(d)
		case "stats":
			s := sc.Stats()
			line := fmt.Sprintf("running %d waiting %d inflight %d kv %d/%d preemptions %d discarded %d finished %d cancelled %d steps %d steptime %v/%v",
				s.Running, s.Waiting, s.InFlight, s.KVBlocksUsed, s.KVBlocks, s.Preemptions, s.Discarded, s.Finished, s.Cancelled, s.Steps, s.LastStepTime, s.StepTime)
			if s.Failed+s.Reprefilled > 0 {
				line += fmt.Sprintf(" failed %d reprefilled %d (%d tokens)", s.Failed, s.Reprefilled, s.ReprefilledTokens)
			}
			if s.Refused > 0 {
				line += fmt.Sprintf(" refused %d", s.Refused)
			}
			print("%s", line)
		default:
			t.Fatalf("line %d: unknown command %q", n+1, f[0])
		}
	}
	return out.String()
}

// tokenList prints tokens with runs of three or more consecutive ids as
// first-last, and stage.Placeholder as _.
func tokenList(ts []int32) string {
	var parts []string
	for i := 0; i < len(ts); {
		j := i + 1
		for j < len(ts) && ts[j] == ts[j-1]+1 && ts[i] >= 0 {
			j++
		}
		switch {
		case ts[i] == stage.Placeholder:
			parts = append(parts, "_")
			j = i + 1
		case j-i >= 3:
			parts = append(parts, fmt.Sprintf("%d-%d", ts[i], ts[j-1]))
		default:
			j = i + 1
			parts = append(parts, strconv.Itoa(int(ts[i])))
		}
		i = j
	}
	return "[" + strings.Join(parts, " ") + "]"
}
