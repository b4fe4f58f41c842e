package main

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"strings"

	"github.com/spf13/cobra"

	"github.com/tandem-llm/tandem/model/chat"
)

func newChatTemplateCmd() *cobra.Command {
	var path, name string
	cmd := &cobra.Command{
		Use:   "chat-template --template FILE",
		Short: "Render conversations with a chat template, as Hugging Face does",
		Long: `Read a JSON array of conversations on stdin, each
  {"messages": [...], "tools": [...], "add_generation_prompt": true,
   "continue_final_message": false, "kwargs": {"bos_token": "<s>", ...}}
render each with the chat template and print a JSON array with, for each,
{"output": TEXT} or {"error": MESSAGE}: what the model would be given, as
llama.cpp's /apply-template shows it.

FILE is a template (.jinja), a tokenizer_config.json (its chat_template and
special tokens; --name picks a named template) or a model directory.
kwargs are the template's extra variables (bos_token, eos_token,
enable_thinking ...); they override a tokenizer_config.json's special
tokens.`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			set, err := loadTemplates(path)
			if err != nil {
				return err
			}
			tmpl, err := set.Select(name, false)
			if err != nil {
				return err
			}
			return renderTemplate(tmpl, cmd.InOrStdin(), cmd.OutOrStdout())
		},
	}
	f := cmd.Flags()
	f.StringVar(&path, "template", "", "chat template file, tokenizer_config.json or model directory (required)")
	f.StringVar(&name, "name", "", "the named template to use (default: the default one)")
	cmd.MarkFlagRequired("template")
	return cmd
}

// loadTemplates reads a .jinja file, a tokenizer_config.json or a model
// directory.
func loadTemplates(path string) (*chat.Set, error) {
	if st, err := os.Stat(path); err == nil && st.IsDir() {
		return chat.Load(path, nil)
	}
	data, err := os.ReadFile(path)
	if err != nil {
		return nil, fmt.Errorf("read the template: %w", err)
	}
	if strings.HasSuffix(path, ".json") {
		set, err := chat.Parse(data, nil, nil)
		if err != nil {
			return nil, fmt.Errorf("%s: %w", path, err)
		}
		return set, nil
	}
	return chat.Parse(nil, map[string]string{chat.DefaultName: string(data)}, nil)
}

type templateInput struct {
	Messages             json.RawMessage            `json:"messages"`
	Tools                json.RawMessage            `json:"tools"`
	AddGenerationPrompt  bool                       `json:"add_generation_prompt"`
	ContinueFinalMessage bool                       `json:"continue_final_message"`
	Kwargs               map[string]json.RawMessage `json:"kwargs"`
}

type templateOutput struct {
	Output *string `json:"output,omitempty"`
	Error  string  `json:"error,omitempty"`
}

func renderTemplate(tmpl *chat.Template, in io.Reader, out io.Writer) error {
	var inputs []templateInput
	if err := json.NewDecoder(in).Decode(&inputs); err != nil {
		return fmt.Errorf("read stdin: want a JSON array of {\"messages\", \"tools\", \"add_generation_prompt\", \"continue_final_message\", \"kwargs\"}: %w", err)
	}
	if inputs == nil {
		return errors.New("read stdin: want a JSON array, got null")
	}
	res := make([]templateOutput, len(inputs))
	for i, x := range inputs {
		text, err := tmpl.Render(chat.Request{
			Messages:             x.Messages,
			Tools:                x.Tools,
			AddGenerationPrompt:  x.AddGenerationPrompt,
			ContinueFinalMessage: x.ContinueFinalMessage,
			Kwargs:               x.Kwargs,
		})
		if err != nil {
			res[i].Error = err.Error()
		} else {
			res[i].Output = &text
		}
	}
	var buf bytes.Buffer
	enc := json.NewEncoder(&buf)
	enc.SetEscapeHTML(false)
	enc.SetIndent("", "  ")
	if err := enc.Encode(res); err != nil {
		return err
	}
	_, err := out.Write(buf.Bytes())
	return err
}
