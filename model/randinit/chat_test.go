package randinit

import (
	"reflect"
	"slices"
	"testing"

	"github.com/tandem-llm/tandem/model"
	"github.com/tandem-llm/tandem/model/chat"
	hftok "github.com/tandem-llm/tandem/model/tokenizer"
)

// TestChatFiles: the checkpoint's chat template renders a conversation
// through model/chat, the rendered prompt tokenises with one BOS and
// the turn-ending EOS ids, and generation_config.json reads back as the
// defaults it states.
func TestChatFiles(t *testing.T) {
	dir := writeDir(t, DefaultOptions())
	set, err := chat.Load(dir, nil)
	if err != nil {
		t.Fatal(err)
	}
	tmpl, err := set.Select("", false)
	if err != nil {
		t.Fatal(err)
	}
	out, err := tmpl.Render(chat.Request{
		Messages:            []byte(`[{"role":"system","content":"Be brief. "},{"role":"user","content":"Hello there"}]`),
		AddGenerationPrompt: true,
	})
	if err != nil {
		t.Fatal(err)
	}
	want := BOSToken + "### system\nBe brief." + EOSToken + "\n### user\nHello there" + EOSToken + "\n### assistant\n"
	if out != want {
		t.Fatalf("rendered %q, want %q", out, want)
	}
	if _, err := tmpl.Render(chat.Request{Messages: []byte(`[{"role":"user","content":[{"type":"text","text":"x"}]}]`)}); err == nil {
		t.Error("a content of parts rendered; want the template's exception")
	}
	tok, err := hftok.Load(dir + "/tokenizer.json")
	if err != nil {
		t.Fatal(err)
	}
	cfg, err := model.LoadConfig(dir)
	if err != nil {
		t.Fatal(err)
	}
	ids := chat.PromptTokens(tok, out, true)
	var bos, eos int
	for _, id := range ids {
		bos += b2i(int(id) == cfg.BOS)
		eos += b2i(slices.Contains(cfg.EOS, int(id)))
	}
	if ids[0] != int32(cfg.BOS) || bos != 1 || eos != 2 {
		t.Errorf("prompt ids %v: want BOS first and once, EOS twice", ids)
	}
	gen, err := model.LoadGenerationConfig(dir, cfg.VocabSize)
	if err != nil {
		t.Fatal(err)
	}
	temp, topP, topK := GenTemperature, GenTopP, GenTopK
	if want := (model.GenerationConfig{Temperature: &temp, TopP: &topP, TopK: &topK, EOS: cfg.EOS}); !reflect.DeepEqual(*gen, want) {
		t.Errorf("generation config %+v, want %+v", *gen, want)
	}
}

func b2i(b bool) int {
	if b {
		return 1
	}
	return 0
}
