package main

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"io"
	"strings"

	oa "github.com/openai/openai-go/v3"
	"github.com/openai/openai-go/v3/option"
	"github.com/spf13/cobra"
)

type chatOptions struct {
	url, model, system string
	temperature        float64
	maxTokens          int
}

func newChatCmd() *cobra.Command {
	var o chatOptions
	cmd := &cobra.Command{
		Use:   "chat --url http://HOST:PORT/v1",
		Short: "Chat with the served model in the terminal",
		Long: `A small interactive client of the leader's OpenAI-compatible endpoint: each
line typed is a user turn; the reply streams back as it is generated, and
the conversation is kept, so later turns see earlier ones. An empty line is
ignored; end of input (Ctrl-D) ends the chat. A turn the server refuses is
reported and left out of the conversation.`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			return chatLoop(cmd.Context(), o, cmd.InOrStdin(), cmd.OutOrStdout())
		},
	}
	f := cmd.Flags()
	f.StringVar(&o.url, "url", "http://127.0.0.1:8000/v1", "the OpenAI endpoint of the leader")
	f.StringVar(&o.model, "model", "", "the model (default: the one the endpoint serves)")
	f.StringVar(&o.system, "system", "", "a system message to start the conversation with")
	f.Float64Var(&o.temperature, "temperature", -1, "sampling temperature (default: the model's)")
	f.IntVar(&o.maxTokens, "max-tokens", 0, "the most tokens of a reply (default: up to the context)")
	return cmd
}

// chatLoop reads user turns from in, one a line, and streams each reply
// to out.
func chatLoop(ctx context.Context, o chatOptions, in io.Reader, out io.Writer) error {
	client := oa.NewClient(option.WithBaseURL(strings.TrimSuffix(o.url, "/")+"/"), option.WithAPIKey("tandem"), option.WithMaxRetries(0))
	if o.model == "" {
		page, err := client.Models.List(ctx)
		if err != nil {
			return fmt.Errorf("ask %s for its model: %w", o.url, err)
		}
		if len(page.Data) == 0 {
			return fmt.Errorf("%s serves no model", o.url)
		}
		o.model = page.Data[0].ID
	}
	var history []oa.ChatCompletionMessageParamUnion
	if o.system != "" {
		history = append(history, oa.SystemMessage(o.system))
	}
	lines := bufio.NewScanner(in)
	lines.Buffer(make([]byte, 64<<10), 1<<20)
	for {
		fmt.Fprint(out, "> ")
		if !lines.Scan() {
			fmt.Fprintln(out)
			return lines.Err()
		}
		line := strings.TrimSpace(lines.Text())
		if line == "" {
			continue
		}
		history = append(history, oa.UserMessage(line))
		params := oa.ChatCompletionNewParams{Model: o.model, Messages: history}
		if o.temperature >= 0 {
			params.Temperature = oa.Float(o.temperature)
		}
		if o.maxTokens > 0 {
			params.MaxCompletionTokens = oa.Int(int64(o.maxTokens))
		}
		reply, err := streamReply(ctx, client, params, out)
		if err != nil {
			var apiErr *oa.Error
			if errors.As(err, &apiErr) {
				// The server refused this turn: say why and go on.
				fmt.Fprintf(out, "\n[error %d: %s]\n", apiErr.StatusCode, apiErr.Message)
				history = history[:len(history)-1]
				continue
			}
			return err
		}
		history = append(history, oa.AssistantMessage(reply))
	}
}

// streamReply streams one reply to out and returns its text.
func streamReply(ctx context.Context, client oa.Client, params oa.ChatCompletionNewParams, out io.Writer) (string, error) {
	stream := client.Chat.Completions.NewStreaming(ctx, params)
	defer stream.Close()
	var reply strings.Builder
	finish := ""
	for stream.Next() {
		for _, c := range stream.Current().Choices {
			fmt.Fprint(out, c.Delta.Content)
			reply.WriteString(c.Delta.Content)
			if c.FinishReason != "" {
				finish = c.FinishReason
			}
		}
	}
	if err := stream.Err(); err != nil {
		return "", err
	}
	if finish == "length" {
		fmt.Fprint(out, " [cut: max tokens]")
	}
	fmt.Fprintln(out)
	return reply.String(), nil
}
