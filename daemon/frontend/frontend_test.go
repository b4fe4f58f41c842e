package frontend

import (
	"fmt"
	"math"
	"path/filepath"
	"runtime"
	"slices"
	"strings"
	"testing"
	"unicode/utf8"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"

	"github.com/tandem-llm/tandem/daemon/apierr"
	"github.com/tandem-llm/tandem/daemon/textout"
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

// testConfig is the frontend's configuration for the checkpoint in dir:
// its generation defaults are those randinit writes.
func testConfig(t testing.TB, dir string, ckpt *model.Checkpoint, tok *tokenizer.Tokenizer, engines Engines) Config {
	t.Helper()
	gen, err := model.LoadGenerationConfig(dir, ckpt.Config().VocabSize)
	if err != nil {
		t.Fatal(err)
	}
	return Config{Model: ckpt.Config(), Tokenizer: tok, Generation: gen, Name: "tiny", Engines: engines}
}

// TestValidate checks every refusal of a Generate request: the gRPC code is
// INVALID_ARGUMENT and the message names the field; and what a valid
// request turns into.
func TestValidate(t *testing.T) {
	dir := testModel(t)
	ckpt, tok := openTestModel(t, dir)
	cfg := ckpt.Config()
	s := New(testConfig(t, dir, ckpt, tok, nil))
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
		{"inf temperature", &tandemv1.GenerateRequest{Prompt: "x", Temperature: proto.Float32(float32(math.Inf(1)))}, "temperature"},
		{"negative temperature", &tandemv1.GenerateRequest{Prompt: "x", Temperature: proto.Float32(-0.5)}, "temperature"},
		{"NaN top_p", &tandemv1.GenerateRequest{Prompt: "x", TopP: proto.Float32(float32(math.NaN()))}, "top_p"},
		{"top_p", &tandemv1.GenerateRequest{Prompt: "x", TopP: proto.Float32(-0.1)}, "top_p"},
		{"top_k", &tandemv1.GenerateRequest{Prompt: "x", TopK: proto.Int32(-1)}, "top_k -1"},
		{"top_k past vocab", &tandemv1.GenerateRequest{Prompt: "x", TopK: proto.Int32(int32(cfg.VocabSize + 1))}, "larger than the vocabulary"},
		{"logprobs", &tandemv1.GenerateRequest{Prompt: "x", Logprobs: proto.Uint32(21)}, "logprobs 21"},
	} {
		_, err := s.validate(tc.req)
		st := status.Convert(apierr.GRPC(err))
		if st.Code() != codes.InvalidArgument || !strings.Contains(st.Message(), tc.want) {
			t.Errorf("%s: %v, want INVALID_ARGUMENT mentioning %q", tc.name, err, tc.want)
		}
	}
	g, err := s.validate(&tandemv1.GenerateRequest{Prompt: "Hello", StopTokenIds: []int32{7}, Temperature: proto.Float32(0.5), TopK: proto.Int32(3), Seed: 9, Logprobs: proto.Uint32(0)})
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
	if sp := g.req.Sampling; sp.Temperature != 0.5 || sp.TopP != float32(randinit.GenTopP) {
		t.Errorf("sampling %+v: want the request's temperature 0.5, top-k 3, and the checkpoint's top-p %v", sp, randinit.GenTopP)
	}
	// A prompt that spells the BOS token keeps one BOS, as the OpenAI
	// completions endpoint encodes it (chat.PromptTokens).
	g, err = s.validate(&tandemv1.GenerateRequest{Prompt: randinit.BOSToken + "Hello"})
	if want := tok.Encode("Hello", true); err != nil || !slices.Equal(g.req.Prompt, want) {
		t.Errorf("prompt beginning with the BOS text: %v, %v; want %v (one BOS)", g.req.Prompt, err, want)
	}
	g, err = s.validate(&tandemv1.GenerateRequest{PromptTokenIds: []int32{4}, IgnoreEos: true})
	if err != nil || len(g.req.StopTokens) != 0 || g.logprobs {
		t.Errorf("ignore_eos: stops %v, logprobs %t, err %v; want no stops, no logprobs", g.req.StopTokens, g.logprobs, err)
	}
	// Unset sampling fields take generation_config.json's values; set
	// ones, zeros included, win.
	if sp := g.req.Sampling; sp.Temperature != float32(randinit.GenTemperature) || sp.TopP != float32(randinit.GenTopP) || sp.TopK != randinit.GenTopK {
		t.Errorf("unset sampling: %+v, want the checkpoint's defaults", sp)
	}
	g, err = s.validate(&tandemv1.GenerateRequest{PromptTokenIds: []int32{4}, Temperature: proto.Float32(0), TopP: proto.Float32(0), TopK: proto.Int32(0)})
	if sp := g.req.Sampling; err != nil || sp.Temperature != 0 || sp.TopP != 0 || sp.TopK != 0 {
		t.Errorf("explicit zeros: %+v, %v; want greedy decoding, no filters", sp, err)
	}
	// Without a generation_config.json, unset means greedy.
	noGen := testConfig(t, dir, ckpt, tok, nil)
	noGen.Generation = nil
	g, err = New(noGen).validate(&tandemv1.GenerateRequest{PromptTokenIds: []int32{4}})
	if sp := g.req.Sampling; err != nil || sp.Temperature != 0 || sp.TopP != 0 || sp.TopK != 0 {
		t.Errorf("no defaults: %+v, %v; want greedy decoding, no filters", sp, err)
	}
}

// TestLongPromptRefusedUnencoded: a text prompt longer than any prompt
// of the context can be is refused (INVALID_ARGUMENT, in bytes) without
// being encoded: validating 4 MB allocates next to nothing, where
// encoding it took megabytes per request. A prompt just within the bound
// is encoded and refused by its tokens.
func TestLongPromptRefusedUnencoded(t *testing.T) {
	dir := testModel(t)
	ckpt, tok := openTestModel(t, dir)
	s := New(testConfig(t, dir, ckpt, tok, nil))
	most := tok.MaxTextBytes(ckpt.Config().MaxPositions)
	huge := strings.Repeat("lorem ipsum ", 4<<20/12)
	if len(huge) <= most {
		t.Fatalf("a prompt of %d bytes is within the bound of %d", len(huge), most)
	}
	var before, after runtime.MemStats
	runtime.ReadMemStats(&before)
	_, err := s.validate(&tandemv1.GenerateRequest{Prompt: huge})
	runtime.ReadMemStats(&after)
	st := status.Convert(apierr.GRPC(err))
	if st.Code() != codes.InvalidArgument || !strings.Contains(st.Message(), fmt.Sprintf("prompt of %d bytes", len(huge))) {
		t.Errorf("a %d-byte prompt: %v, want INVALID_ARGUMENT in bytes", len(huge), err)
	}
	if alloc := after.TotalAlloc - before.TotalAlloc; alloc > 64<<10 {
		t.Errorf("refusing a %d-byte prompt allocated %d bytes: it was encoded", len(huge), alloc)
	}
	_, err = s.validate(&tandemv1.GenerateRequest{Prompt: huge[:most]})
	if st := status.Convert(apierr.GRPC(err)); st.Code() != codes.InvalidArgument || !strings.Contains(st.Message(), "tokens plus max_tokens") {
		t.Errorf("a prompt of the bound's %d bytes: %v, want it encoded and refused by its tokens", most, err)
	}
}

// FuzzGenerateRequest feeds arbitrary prompts, token ids and stop strings
// (what a client controls) to the request validation and, for requests it
// accepts, streams the prompt's tokens back through the request's output
// processor: nothing panics, refusals are INVALID_ARGUMENT, and the text
// released is valid UTF-8 and a prefix of the tokenizer's decode.
func FuzzGenerateRequest(f *testing.F) {
	dir := testModel(f)
	ckpt, tok := openTestModel(f, dir)
	s := New(testConfig(f, dir, ckpt, tok, nil))
	f.Add("Hello, world", []byte{1, 2, 3}, "wor", float32(0.5), uint32(4))
	f.Add("", []byte{}, "", float32(-1), uint32(0))
	f.Add("héllo ✓ 日本", []byte{255, 0, 7}, "日", float32(1), uint32(3000))
	f.Fuzz(func(t *testing.T, prompt string, ids []byte, stop string, temp float32, maxTokens uint32) {
		req := &tandemv1.GenerateRequest{Prompt: prompt, Stop: []string{stop}, Temperature: &temp, MaxTokens: maxTokens}
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
		text := textout.New(tok, textout.Config{Stop: g.stop})
		var got string
		for _, id := range g.req.Prompt {
			d := text.Add(id)
			got += d.Text
			if d.Stopped {
				break
			}
		}
		got += text.Finish()
		if full := tok.Decode(g.req.Prompt, true); !strings.HasPrefix(full, got) || !utf8.ValidString(got) {
			t.Fatalf("streamed %q, not a valid prefix of %q", got, full)
		}
	})
}
