package frontend

import (
	"math"
	"math/rand/v2"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"unicode/utf8"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"

	"github.com/tandem-llm/tandem/daemon/apierr"
	"github.com/tandem-llm/tandem/model"
	"github.com/tandem-llm/tandem/model/randinit"
	"github.com/tandem-llm/tandem/model/tokenizer"
	tandemv1 "github.com/tandem-llm/tandem/proto/tandem/v1"
)

// testModel writes a tiny random checkpoint and returns its directory.
func testModel(t testing.TB) string {
	t.Helper()
	dir := filepath.Join(t.TempDir(), "model")
	o := randinit.DefaultOptions()
	o.Seed = 5
	if err := randinit.Write(dir, o); err != nil {
		t.Fatal(err)
	}
	return dir
}

func openTestModel(t testing.TB, dir string) (*model.Checkpoint, *tokenizer.Tokenizer) {
	t.Helper()
	ckpt, err := model.Open(dir)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { ckpt.Close() })
	tok, err := tokenizer.Load(filepath.Join(dir, "tokenizer.json"))
	if err != nil {
		t.Fatal(err)
	}
	return ckpt, tok
}

// streamText feeds ids to a textStream as Generate does and returns the
// text released and whether a stop string ended it.
func streamText(tok *tokenizer.Tokenizer, ids []int32, stop []string) (string, bool) {
	ts := newTextStream(tok, stop)
	var out strings.Builder
	for _, id := range ids {
		out.WriteString(ts.add(id))
		if ts.stopped {
			return out.String(), true
		}
	}
	out.WriteString(ts.flush())
	return out.String(), ts.stopped
}

// TestTextStreamMatchesDecode checks, on random token sequences, that the
// text Generate streams is the tokenizer's Decode of all the tokens, cut
// before the first occurrence of the stop string when there is one.
func TestTextStreamMatchesDecode(t *testing.T) {
	_, tok := openTestModel(t, testModel(t))
	rng := rand.New(rand.NewPCG(1, 2))
	stopped := 0
	for trial := range 400 {
		ids := make([]int32, 1+rng.IntN(24))
		for i := range ids {
			ids[i] = int32(rng.IntN(tok.VocabSize()))
		}
		full := tok.Decode(ids, true)
		var stop string
		if trial%4 != 0 && len(full) > 0 {
			// A substring of the text, on rune boundaries, so it occurs.
			runes := []rune(full)
			i := rng.IntN(len(runes))
			stop = string(runes[i:min(len(runes), i+1+rng.IntN(4))])
		} else {
			stop = "\x00never"
		}
		want, wantStop := full, false
		if i := strings.Index(full, stop); i >= 0 {
			want, wantStop = full[:i], true
			stopped++
		}
		got, gotStop := streamText(tok, ids, []string{stop})
		if got != want || gotStop != wantStop {
			t.Fatalf("ids %v, stop %q: streamed %q (stopped %t), want %q (stopped %t)", ids, stop, got, gotStop, want, wantStop)
		}
		if !utf8.ValidString(got) {
			t.Fatalf("ids %v: streamed invalid UTF-8 %q", ids, got)
		}
	}
	if stopped < 100 {
		t.Errorf("only %d of 400 trials hit their stop string", stopped)
	}
}

func TestStopStringHelpers(t *testing.T) {
	for _, tc := range []struct {
		s     string
		stop  []string
		first int
		held  int
	}{
		{"hello wor", []string{"world"}, -1, 3},
		{"hello world!", []string{"world"}, 6, 0},
		{"abcd", []string{"bc", "abcd"}, 0, 0},
		{"xab", []string{"abc", "b"}, 2, 2},
		{"tail", []string{"l", "ail!"}, 3, 3},
		{"", []string{"x"}, -1, 0},
		{"aaa", []string{"aab"}, -1, 2},
		{"héllo wö", []string{"wörld"}, -1, 3},
	} {
		if got := firstStop(tc.s, tc.stop); got != tc.first {
			t.Errorf("firstStop(%q, %q) = %d, want %d", tc.s, tc.stop, got, tc.first)
		}
		if got := heldBack(tc.s, tc.stop); got != tc.held {
			t.Errorf("heldBack(%q, %q) = %d, want %d", tc.s, tc.stop, got, tc.held)
		}
	}
}

// TestValidate checks every refusal of a Generate request: the gRPC code is
// INVALID_ARGUMENT and the message names the field; and what a valid
// request turns into.
func TestValidate(t *testing.T) {
	ckpt, tok := openTestModel(t, testModel(t))
	cfg := ckpt.Config()
	s := New(cfg, tok, nil)
	for _, tc := range []struct {
		name string
		req  *tandemv1.GenerateRequest
		want string
	}{
		{"empty", &tandemv1.GenerateRequest{}, "empty prompt"},
		{"both", &tandemv1.GenerateRequest{Prompt: "x", PromptTokenIds: []int32{1}}, "both set"},
		{"id past vocab", &tandemv1.GenerateRequest{PromptTokenIds: []int32{0, int32(cfg.VocabSize)}}, "prompt_token_ids[1]"},
		{"negative id", &tandemv1.GenerateRequest{PromptTokenIds: []int32{-5}}, "prompt_token_ids[0] = -5"},
		{"context", &tandemv1.GenerateRequest{PromptTokenIds: []int32{1, 2}, MaxTokens: uint32(cfg.MaxPositions - 1)}, "exceeds the context length"},
		{"too many stops", &tandemv1.GenerateRequest{Prompt: "x", Stop: make([]string, 17)}, "17 stop strings"},
		{"long stop", &tandemv1.GenerateRequest{Prompt: "x", Stop: []string{strings.Repeat("a", 257)}}, "stop[0]"},
		{"bad utf8 stop", &tandemv1.GenerateRequest{Prompt: "x", Stop: []string{"\xff"}}, "stop[0]"},
		{"stop id", &tandemv1.GenerateRequest{Prompt: "x", StopTokenIds: []int32{1, -1}}, "stop_token_ids[1]"},
		{"too many stop ids", &tandemv1.GenerateRequest{Prompt: "x", StopTokenIds: make([]int32, 65)}, "65 stop token ids"},
		{"inf temperature", &tandemv1.GenerateRequest{Prompt: "x", Temperature: float32(math.Inf(1))}, "temperature"},
		{"negative temperature", &tandemv1.GenerateRequest{Prompt: "x", Temperature: -0.5}, "temperature"},
		{"NaN top_p", &tandemv1.GenerateRequest{Prompt: "x", TopP: float32(math.NaN())}, "top_p"},
		{"top_p", &tandemv1.GenerateRequest{Prompt: "x", TopP: -0.1}, "top_p"},
		{"top_k", &tandemv1.GenerateRequest{Prompt: "x", TopK: -1}, "top_k -1"},
		{"top_k past vocab", &tandemv1.GenerateRequest{Prompt: "x", TopK: int32(cfg.VocabSize + 1)}, "larger than the vocabulary"},
		{"logprobs", &tandemv1.GenerateRequest{Prompt: "x", Logprobs: proto.Uint32(21)}, "logprobs 21"},
	} {
		_, err := s.validate(tc.req)
		st := status.Convert(apierr.GRPC(err))
		if st.Code() != codes.InvalidArgument || !strings.Contains(st.Message(), tc.want) {
			t.Errorf("%s: %v, want INVALID_ARGUMENT mentioning %q", tc.name, err, tc.want)
		}
	}
	g, err := s.validate(&tandemv1.GenerateRequest{Prompt: "Hello", StopTokenIds: []int32{7}, Temperature: 0.5, TopK: 3, Seed: 9, Logprobs: proto.Uint32(0)})
	if err != nil {
		t.Fatal(err)
	}
	if want := tok.Encode("Hello", true); !slices.Equal(g.req.Prompt, want) {
		t.Errorf("prompt %v, want the tokenizer's %v", g.req.Prompt, want)
	}
	if g.req.MaxTokens != defaultMaxTokens || !g.logprobs || g.req.Sampling.TopK != 3 || g.req.Sampling.Seed != 9 {
		t.Errorf("request %+v, logprobs %t: want max tokens %d, logprobs on, top-k 3, seed 9", g.req, g.logprobs, defaultMaxTokens)
	}
	wantStops := []int32{7}
	for _, id := range cfg.EOS {
		wantStops = append(wantStops, int32(id))
	}
	if !slices.Equal(g.req.StopTokens, wantStops) {
		t.Errorf("stop tokens %v, want %v (the request's, then EOS)", g.req.StopTokens, wantStops)
	}
	g, err = s.validate(&tandemv1.GenerateRequest{PromptTokenIds: []int32{4}, IgnoreEos: true})
	if err != nil || len(g.req.StopTokens) != 0 || g.logprobs {
		t.Errorf("ignore_eos: stops %v, logprobs %t, err %v; want no stops, no logprobs", g.req.StopTokens, g.logprobs, err)
	}
}

// FuzzGenerateRequest feeds arbitrary prompts, token ids and stop strings
// (what a client controls) to the request validation and, for requests it
// accepts, streams the prompt's tokens back through the stop-string
// filter: nothing panics, refusals are INVALID_ARGUMENT, and the text
// released is valid UTF-8 and a prefix of the tokenizer's decode.
func FuzzGenerateRequest(f *testing.F) {
	ckpt, tok := openTestModel(f, testModel(f))
	s := New(ckpt.Config(), tok, nil)
	f.Add("Hello, world", []byte{1, 2, 3}, "wor", float32(0.5), uint32(4))
	f.Add("", []byte{}, "", float32(-1), uint32(0))
	f.Add("héllo ✓ 日本", []byte{255, 0, 7}, "日", float32(1), uint32(3000))
	f.Fuzz(func(t *testing.T, prompt string, ids []byte, stop string, temp float32, maxTokens uint32) {
		req := &tandemv1.GenerateRequest{Prompt: prompt, Stop: []string{stop}, Temperature: temp, MaxTokens: maxTokens}
		for i := 0; i+1 < len(ids); i += 2 {
			req.PromptTokenIds = append(req.PromptTokenIds, int32(int16(uint16(ids[i])<<8|uint16(ids[i+1]))))
		}
		g, err := s.validate(req)
		if err != nil {
			if c := status.Code(apierr.GRPC(err)); c != codes.InvalidArgument {
				t.Fatalf("refusal %v has code %v", err, c)
			}
			return
		}
		got, _ := streamText(tok, g.req.Prompt, g.stop)
		if full := tok.Decode(g.req.Prompt, true); !strings.HasPrefix(full, got) || !utf8.ValidString(got) {
			t.Fatalf("streamed %q, not a valid prefix of %q", got, full)
		}
	})
}
